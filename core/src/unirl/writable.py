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

import errno
import os
from pathlib import Path

from unirl.fsio import probe_write
from unirl.kernel.errors import ConfigError, Violation

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
