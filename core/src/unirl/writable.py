"""Can a path be written? Asked before any model is built, by a real write.

Why a probe and not ``os.access``: a read-only mount (EROFS), a full disk, a quota, or a path whose
parent is a file all pass or fail ``os.access`` differently from the write that comes minutes later, and
root passes every permission check on paper. So the nearest directory that exists on the way to the path
gets a small file created, written, fsynced and removed (:func:`unirl.fsio.probe_write`); its error is
the one the run would have hit. Nothing else is created: a directory that does not exist yet is made by
the command itself, later.

Used by every output claim (:mod:`unirl.outputs`: ``--out`` of export and eval, agentic-data's files, ...)
and by preflight for ``run.output_dir`` and the caches the run writes (:func:`writable_violations`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from unirl.fsio import probe_write, write_error
from unirl.kernel.errors import ConfigError, UniRLError, Violation

#: cache directories a run writes when the environment names them (compiled kernels); a datasets cache is
#: left out: reading one offline from a read-only mount is legitimate
CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


class OutputNotWritableError(ConfigError):
    """A path a command writes cannot be written (read-only, a file on the way, no space); nothing ran."""


def unwritable(path: str | os.PathLike) -> str | None:
    """Why ``path`` (a file or directory to create or replace) cannot be written, or None. The fix is
    the caller's to name (it knows the field)."""
    path = Path(path).absolute()
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            return f"{parent} is a file, not a directory"
        if parent.exists():
            break
    where = path if path.is_dir() else next(p for p in path.parents if p.is_dir())
    exc = probe_write(where / ".unirl-writable")
    if exc is None:
        return None
    code = errno.errorcode.get(exc.errno or 0, "error")
    how = {errno.EROFS: "it is on a read-only file system", errno.ENOSPC: "its disk is full",
           errno.EDQUOT: "its disk quota is used up"}.get(exc.errno or 0, "writing there fails")
    return f"cannot write in {where}: {how} ({code}: {exc.strerror})"


def check_writable(path: str | os.PathLike, field: str, fix: str = "choose a writable path") -> None:
    """Raise :class:`OutputNotWritableError` (one line: the field, the path, why, the fix) when
    :func:`unwritable` says so."""
    why = unwritable(path)
    if why is not None:
        raise OutputNotWritableError(f"{field} {path}: {why}; nothing was written (fix: {fix})")


def writable_violations(config: object) -> list[Violation]:
    """Preflight: the run directory (``run.output_dir`` / ``run.name``) and the cache directories the
    environment names can be written."""
    out: list[Violation] = []
    run_dir = config.run_dir  # type: ignore[attr-defined]
    why = unwritable(run_dir)
    if why is not None:
        out.append(Violation("unirl-core", "run.output_dir", f"{run_dir}: {why}",
                             "set run.output_dir to a writable directory (e.g. run.output_dir=runs on a local disk)"))
    for var in CACHE_VARIABLES:
        value = os.environ.get(var)
        if value:
            why = unwritable(value)
            if why is not None:
                out.append(Violation("unirl-core", f"{var} (environment)", f"{value}: {why}",
                                     f"point {var} at a writable directory, or unset it"))
    return out


def check_free(path: str | os.PathLike, needed: int | None, field: str, what: str) -> None:
    """Raise :class:`OutputNotWritableError` when the disk under ``path`` has less than ``needed`` bytes
    free (a size known before the work starts: an export is about its checkpoint's weights)."""
    if not needed:
        return
    where = next((p for p in (Path(path).absolute(), *Path(path).absolute().parents) if p.is_dir()), Path("/"))
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return
    if free < needed:
        raise OutputNotWritableError(f"{field} {path}: {what} needs about {needed / 1e6:.1f} MB, {free / 1e6:.1f} MB "
                                     f"free under {where}; nothing was written (fix: free space there, or choose a "
                                     "path on a bigger disk)")


@contextlib.contextmanager
def disk_errors(path: str | os.PathLike, field: str, what: str) -> Iterator[None]:
    """Around a command's write of ``path``: a failure of the disk (:func:`unirl.fsio.write_error`:
    ENOSPC from ``torch.save`` included) becomes one :class:`OutputNotWritableError` line with the field
    and the fix, not a traceback; anything else passes unchanged."""
    try:
        yield
    except UniRLError:
        raise
    except Exception as exc:
        os_exc = write_error(exc, path)
        if os_exc is None:
            raise
        code = errno.errorcode.get(os_exc.errno or 0, "error")
        raise OutputNotWritableError(f"{field} {path}: {os_exc.strerror} ({code}) while writing {what}; nothing "
                                     "earlier was replaced (fix: free space there, or choose a path on another "
                                     "disk)") from exc
