"""The project's one atomic file write and one directory swap.

Why one module: each writer that rolled its own (checkpoints, the metrics rewrite, the parity artifact,
...) picked its own fsync rules, so whether a file survived a power cut depended on who wrote it. Here
the rule is stated once: a file is written to a temp sibling, flushed and fsynced, renamed over the
target with ``os.replace`` (atomic on POSIX), and the parent directory fsynced so the rename itself is
durable. A directory is staged as a sibling and swapped in with :func:`swap_dir`. Readers therefore
see the old content or the new, never a torn one.

Standard library only: the kernel, the trainer and every plugin (through ``unirl.api``) may use it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def fsync_file(path: str | os.PathLike) -> None:
    """Flush ``path``'s data to disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of directory ``path`` (a rename into it) durable; a no-op where directories
    cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def temp_sibling(path: Path) -> Path:
    """The temp name a write of ``path`` goes through: ``.<name>.tmp-<pid>`` beside it (same
    filesystem, so the rename is atomic; the pid keeps two writers apart; the leading dot and the
    ``.tmp-`` marker let cleaners find what a crashed write left)."""
    return path.parent / f".{path.name}.tmp-{os.getpid()}"


def atomic_write(path: str | os.PathLike, data: str | bytes) -> Path:
    """Replace ``path`` with ``data`` atomically and durably (module doc); create its parent if needed.

    On any error the temp file is removed and ``path`` is untouched."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)

    return atomic_write_with(path, write)


def atomic_write_with(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """:func:`atomic_write` for content a library writes itself (``fig.savefig``, ``save_file``, a
    streamed JSONL): ``write(tmp)`` fills the temp sibling, which is then fsynced and renamed over
    ``path`` under the same rules. On any error (``write``'s included) ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        with as_os_errors(path):  # a library's full disk (torch.save's RuntimeError) as the OSError it is
            write(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_json(path: str | os.PathLike, obj: Any, **dump: Any) -> Path:
    """:func:`atomic_write` of ``json.dumps(obj, **dump)`` plus a final newline."""
    return atomic_write(path, json.dumps(obj, **dump) + "\n")


def swap_dir(tmp: str | os.PathLike, dest: str | os.PathLike, *,
             between: Callable[[], None] | None = None) -> Path:
    """Move the finished directory ``tmp`` to ``dest`` atomically; return ``dest``.

    ``tmp`` must be a sibling of ``dest`` (same filesystem) with its files written (and fsynced by the
    caller when they must survive a power loss). ``tmp`` is fsynced, an existing ``dest`` is moved aside
    to ``<dest>.old-<pid>``, ``tmp`` renamed into place, the parent fsynced, and only then the old copy
    deleted. If the swap fails the old ``dest`` is put back; ``tmp`` is left to the caller. A process
    killed between the two renames leaves ``<dest>.old-<pid>`` for the caller's cleaner to restore.
    ``between`` runs after the old copy is moved aside and before the new one is renamed in (the
    checkpoint code's ``swap:`` phase)."""
    tmp, dest = Path(tmp), Path(dest)
    fsync_dir(tmp)
    old: Path | None = None
    try:
        if dest.exists():
            old = dest.parent / f"{dest.name}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(dest, old)
            if between is not None:
                between()
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        if old is not None and not dest.exists():
            os.replace(old, dest)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return dest


#: what a library's message says when it wraps a full disk (safetensors: "No space left on device (os error
#: 28)"; Python and C++ streams: "[Errno 28]")
_ERRNO_IN_TEXT = re.compile(r"os error (\d+)|\[Errno (\d+)\]|errno[ =:]+(\d+)", re.IGNORECASE)
_PROBE_BYTES = 64 * 1024


def write_error(exc: BaseException, path: str | os.PathLike) -> OSError | None:
    """The ``OSError`` behind a failed write of ``path``, or None when the failure is not the disk's.

    Why: only some writers report a full disk as ``OSError``. ``torch.save`` raises ``RuntimeError``
    ("unexpected pos ... vs ...", "iostream error") with no errno at all, and safetensors its own
    ``SafetensorError`` whose text carries "os error 28". So: an ``OSError`` is itself; an errno in the
    message (or its cause's) is taken from there; otherwise the directory is probed with a small write,
    right away, while the failed file still holds the space it took: the probe's ``OSError`` (ENOSPC,
    EDQUOT, EIO, EROFS) is the one the library hid."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc
    path = Path(path)
    for e in (exc, exc.__cause__, exc.__context__):
        m = _ERRNO_IN_TEXT.search(str(e)) if e is not None else None
        if m:
            code = int(next(g for g in m.groups() if g))
            return OSError(code, os.strerror(code), str(path))
        if e is not None and "no space left" in str(e).lower():
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return probe_write(path)


def probe_write(path: str | os.PathLike, size: int = _PROBE_BYTES) -> OSError | None:
    """Write ``size`` bytes beside ``path`` (in its nearest existing directory), fsync and remove them; the
    ``OSError`` that write raised (with ``path`` as its file name), or None when it succeeded."""
    path = Path(path)
    where = next((p for p in (path, *path.parents) if p.is_dir()), None)
    if where is None:
        return None
    probe = where / f".unirl-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            left = memoryview(b"\0" * size)
            while left:  # a nearly full disk takes part of a write without an error; the rest raises
                left = left[os.write(fd, left):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        return OSError(exc.errno, exc.strerror, str(path))
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None


@contextlib.contextmanager
def as_os_errors(path: str | os.PathLike) -> Iterator[None]:
    """Around a library's write of ``path``: a failure that :func:`write_error` traces to the disk is
    raised as that ``OSError`` (from the original), so every caller catches one type; others pass as they
    are."""
    try:
        yield
    except OSError:
        raise
    except Exception as exc:
        os_exc = write_error(exc, path)
        if os_exc is None:
            raise
        raise os_exc from exc
