"""Versioned weight directories for ``/update_weights_from_disk``.

One sync writes ``<export_dir>/v000007/`` (``model.safetensors`` + the start-up directory's config
and tokenizer files) into a temporary sibling and renames it into place, so a server never sees a
half-written version. The tensors' order and the sender's fingerprint go into the safetensors
metadata; :func:`read_fingerprint` re-reads the file and recomputes the fingerprint, which is the
evidence a receipt carries (the servers load exactly this file). A directory is never rewritten
once in place: the same path always means the same bytes, which is what makes a retried update safe.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from unirl.api import WeightSyncError, fingerprint, fsync_file, swap_dir

if TYPE_CHECKING:  # pragma: no cover
    import torch

WEIGHTS_FILE = "model.safetensors"
#: files copied from the start-up directory so a version directory is a loadable HF directory
_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt")


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{int(version):06d}"


def write_version(root: Path, version: int, tensors: list[tuple[str, torch.Tensor]], sender: str,
                  model_dir: Path) -> Path:
    """Write one version atomically; returns its directory."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name in _SIDE_FILES:
            src = model_dir / name
            if src.is_file():
                shutil.copy2(src, tmp / name)
        meta = {"unirl_version": str(version), "unirl_fingerprint": sender,
                "unirl_order": "\n".join(n for n, _ in tensors)}
        save_file({n: t.contiguous() for n, t in tensors}, str(tmp / WEIGHTS_FILE), metadata=meta)
        fsync_file(tmp / WEIGHTS_FILE)
        # core's one directory swap; an existing ``final`` is replaced (a version number is reused only
        # after a failed sync never committed it)
        swap_dir(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise WeightSyncError(f"could not write weight version {version} to {final}: {exc} "
                              "(rollout.options.export_dir must be writable)") from exc
    return final


def read_fingerprint(path: Path) -> tuple[str, int]:
    """Re-read a version directory; the fingerprint of its tensors in the sender's order, and their count."""
    from safetensors import safe_open

    file = Path(path) / WEIGHTS_FILE
    try:
        with safe_open(str(file), framework="pt") as handle:
            meta = handle.metadata() or {}
            order = meta.get("unirl_order", "").split("\n") if meta.get("unirl_order") else sorted(handle.keys())
            tensors = [(n, handle.get_tensor(n)) for n in order]
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a bad file
        raise WeightSyncError(f"weight directory {path} is unreadable ({type(exc).__name__}: {exc}); "
                              "nothing was sent to the servers") from exc
    return fingerprint(tensors), len(tensors)


def prune(root: Path, keep: int, protect: set[Path]) -> None:
    """Remove all but the newest ``keep`` version directories, never one in ``protect``."""
    if not root.is_dir():
        return
    versions = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("v"))
    for p in versions[:-keep] if keep else versions:
        if p.resolve() not in {q.resolve() for q in protect}:
            shutil.rmtree(p, ignore_errors=True)
