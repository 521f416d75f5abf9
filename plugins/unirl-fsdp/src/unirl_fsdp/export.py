"""A bounded export: the FSDP actor's weights as a Hugging Face directory, one bucket at a time.

Before, ``export_hf`` gathered the whole state dict on rank 0 (``full_state_dict=True``) and wrote it
with ``save_pretrained``: rank 0 held the whole model, plus the ranks' own shards. Now every rank
gathers one tensor at a time (each gather is a collective) and rank 0 keeps it in a bucket; when the
bucket holds ``shard_bytes`` it becomes one safetensors file and is freed. So rank 0 holds at most one
bucket of whole tensors on top of its shards, whatever the model's size.

The directory is what ``save_pretrained`` writes for a sharded checkpoint: ``model-0000i-of-0000N.safetensors``
(``{"format": "pt"}`` metadata), ``model.safetensors.index.json`` (``total_size``, ``weight_map``),
``config.json`` naming the plain HF class, ``generation_config.json`` and the tokenizer. Plain
transformers (``from_pretrained``) and vLLM load it. It is written into a temp sibling and swapped into
place (:func:`unirl.api.staging_dir`): a failed export leaves no partial directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from unirl.api import fsync_file, staging_dir

INDEX = "model.safetensors.index.json"
#: how many bytes of whole tensors one output file (one bucket) holds, one tensor more aside; the FSDP
#: actor passes ``actor.options.bucket_mb``
SHARD_BYTES = 64 * 2**20


def _write_config(tmp: Path, hf_config: Any) -> None:
    """``config.json`` (+ ``generation_config.json``) as ``save_pretrained`` writes them for the plain HF
    class: a shell of that class built on the meta device names itself in ``architectures``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(hf_config)
    shell.config.architectures = [type(shell).__name__]
    shell.config.dtype = "float32"
    shell.config.save_pretrained(str(tmp))
    if shell.can_generate():
        shell.generation_config.save_pretrained(str(tmp))


def export_buckets(path: str | os.PathLike, named: Iterable[tuple[str, torch.Tensor]], *, write: bool,
                   hf_config: Any = None, tokenizer: Any = None, shard_bytes: int = SHARD_BYTES) -> None:
    """Consume ``named`` (whole CPU tensors in HF names; every rank must consume its gathers) and, where
    ``write`` (rank 0), write them as a multi-file safetensors directory at ``path``, a bucket at a time."""
    if not write:
        for _ in named:
            pass
        return
    from safetensors.torch import save_file

    with staging_dir(path) as tmp:  # a temp sibling, swapped into place on success, removed on error
        parts: list[list[str]] = []
        bucket: dict[str, torch.Tensor] = {}
        size = total = 0

        def flush() -> None:
            save_file(bucket, str(tmp / f"part-{len(parts)}.safetensors"), metadata={"format": "pt"})
            parts.append(list(bucket))
            bucket.clear()

        for name, t in named:
            bucket[name] = t.contiguous()
            nbytes = t.numel() * t.element_size()
            size, total = size + nbytes, total + nbytes
            if size >= shard_bytes:
                flush()
                size = 0
        if bucket or not parts:
            flush()
        weight_map = {}
        for i, names in enumerate(parts):
            final = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            os.replace(tmp / f"part-{i}.safetensors", tmp / final)
            fsync_file(tmp / final)
            weight_map.update(dict.fromkeys(names, final))
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                            indent=2, sort_keys=True) + "\n")
        _write_config(tmp, hf_config)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
