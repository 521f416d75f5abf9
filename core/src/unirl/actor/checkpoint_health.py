"""Whether a checkpoint directory can be restored, read cheaply (no tensor is loaded).

:func:`checkpoint_problem` is what a resume asks of each candidate
(:func:`unirl.actor.checkpoint.resume_candidates`) before it loads one: ``meta.json`` parses, every file
it lists is there, each safetensors header fits its file, each ``.pt`` file is a whole zip archive. Why a
module of its own: it reads only the layout (:mod:`unirl.actor.checkpoint_files`), not the save and load
code; re-exported by :mod:`unirl.actor.checkpoint`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from unirl.actor.checkpoint_files import META_FILE


def _safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be whole (cheap: the header and the file size), or None."""
    size = path.stat().st_size
    if size < 8:
        return f"{path.name} is {size} bytes: truncated"
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n <= 0 or 8 + n > size:
            return f"{path.name}: header of {n} bytes does not fit in the {size}-byte file (truncated)"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return f"{path.name}: the header is not JSON (corrupt)"
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    need = 8 + n + max(ends, default=0)
    if need > size:
        return f"{path.name} is {size} bytes, its header needs {need} (truncated)"
    return None


def _torch_file_problem(path: Path) -> str | None:
    """Why a ``torch.save`` file (a zip archive) cannot be whole, or None: the central directory sits at
    the end of the file, so a truncated file has none, and every member must lie inside the file."""
    import zipfile

    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.header_offset + info.compress_size > size:
                    return f"{path.name}: member {info.filename} runs past the end of the file (truncated)"
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        return f"{path.name} is not a whole torch file ({exc}; truncated or overwritten)"
    return None


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why the checkpoint directory ``path`` cannot be restored, or None when it looks whole.

    Cheap (no tensor is read): ``meta.json`` parses, every file it lists is there, each safetensors
    header fits its file and each ``.pt`` file is a whole zip archive. It catches what crashes, full
    disks and copies leave behind (missing and truncated files); a bit flip inside a tensor is not seen."""
    path = Path(path)
    if not path.is_dir():
        return "the directory does not exist"
    meta_path = path / META_FILE
    if not meta_path.is_file():
        return f"no {META_FILE} (a save that never finished)"
    try:
        meta = json.loads(meta_path.read_text())
        files = list(meta["files"])
    except (ValueError, KeyError, TypeError, OSError) as exc:
        return f"{META_FILE} is unreadable ({type(exc).__name__}: {exc})"
    for name in files:
        p = path / name
        if not p.exists():
            return f"{name} is missing"
        if p.is_file():
            check = (_safetensors_problem if name.endswith(".safetensors")
                     else _torch_file_problem if name.endswith(".pt") else None)
            problem = check(p) if check is not None else None
            if problem:
                return problem
    return None
