"""Failed writes (disk full, EIO, permission) during a run: one message, and ``run.on_save_error``.

Why its own module: a checkpoint, the metrics file and the exported model fail the same way and the
user needs the same three facts for each: which path, how many bytes it needs against what is free, and
the fix. ``fail`` (the default) stops the run with that; ``warn`` says it and trains on, and the next
interval retries. Either way nothing already saved is touched: checkpoints are staged and swapped in
whole (:mod:`unirl.actor.checkpoint`), so the previous one and its ``latest`` pointer stay as they were.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from unirl.fsio import write_error
from unirl.kernel.errors import UniRLError


class RunWriteError(UniRLError):
    """A write the run needs failed; the message names the path, the bytes and the fix."""


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def describe(exc: OSError, path: Path, *, what: str, needed: int | None, kept: str) -> str:
    """``<what> <path>: <reason>; needs ~N MB, M MB free on <mount>; <kept> (fix: ...)``."""
    code = errno.errorcode.get(exc.errno or 0, "error")
    probe = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = None
    size = f"needs about {needed / 1e6:.1f} MB" if needed else \
        "needs space for the model and optimizer state" if what == "checkpoint" else "needs more space"
    room = f", {free / 1e6:.1f} MB free under {probe}" if free is not None else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = ("free space there, or set run.output_dir to a bigger disk (run.resume=true continues from the last "
               "checkpoint)")
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = f"make {probe} writable for user {os.getuid()}, or set run.output_dir to a writable directory"
    else:
        fix = "check the disk (dmesg), or set run.output_dir elsewhere"
    return (f"{what} {path}: {exc.strerror or exc} ({code}); {size}{room}; {kept} (fix: {fix}; or set "
            "run.on_save_error=warn to keep training and retry at the next interval)")


def warn_stderr(text: str) -> None:
    """Where a ``warn`` goes by default: stderr, whatever ``trainer.progress`` says (a lost checkpoint is
    not progress to hide)."""
    print(f"unirl {text}", file=sys.stderr, flush=True)


def guarded_write(write: Callable[[], object], *, on_error: str, path: Path, what: str, needed: int | None,
                  kept: str, say: Callable[[str], None] = warn_stderr) -> object | None:
    """Run ``write()``; a failure of the disk (an ``OSError``, or a library's own exception that
    :func:`unirl.fsio.write_error` traces to one) becomes :class:`RunWriteError` (``on_error: fail``) or a
    line said and None (``warn``). Any other exception is a bug and passes unchanged."""
    try:
        return write()
    except UniRLError:
        raise
    except Exception as caught:  # torch.save / safetensors / DCP wrap a full disk in their own types
        exc = write_error(caught, path)
        if exc is None:
            raise
        message = describe(exc, path, what=what, needed=needed, kept=kept)
        if on_error == "warn":
            say(f"warning: {message}; training on (run.on_save_error=warn)")
            return None
        raise RunWriteError(message) from caught
