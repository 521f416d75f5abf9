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

import json
import os
import shutil
from collections.abc import Callable
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
