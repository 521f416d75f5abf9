"""Sharded loading: an FSDP rank holds its shard of the model plus one tensor while the model loads.

Before, every rank built the whole model (``from_pretrained``), cast it whole to fp32 and only then
sharded it: each rank's memory peaked above the whole fp32 model, whatever the number of ranks. Now
(:func:`load_policy`, :func:`empty_like_policy`):

1. the model is built on the meta device (:meth:`unirl.api.ModelAdapter.build_empty`: no memory), made
   fp32 and, with ``actor.lora``, given its adapter, then ``fully_shard`` per block and root as before;
2. ``to_empty`` gives each rank memory for its own shards only;
3. the shards are filled, by one of two paths chosen the same way on every rank:

   * **each rank reads its own rows** (``model.path`` whose safetensors - one file, or several with
     ``model.safetensors.index.json`` - hold every parameter under its own name): one tensor at a time,
     ``safe_open(file).get_slice(name)[rows]`` with the rows FSDP2 gave this rank (dim 0, from the
     DTensor's placement), cast file dtype -> ``model.dtype`` -> fp32 as ``from_pretrained(dtype=)``
     then ``.float()`` did, so the bits are the old load's. The file is opened (mapped) for one tensor
     and closed: a mapping kept open for a whole file would count every page the rank touched in its
     RSS until the file is done. Non-persistent buffers (the rotary ``inv_freq``), which no file holds,
     are computed by transformers' own ``_init_weights`` on the modules that own them, as
     ``from_pretrained`` computes them after its own meta-device load. With ``actor.lora`` the base
     layers read the same way, and the seeded adapter (small, whole on each rank) is drawn on a twin
     that holds no memory (:func:`_seeded_adapter`); the base fingerprint gathers one tensor at a time;
   * **rank 0 builds, every rank receives** (``model.build``, with or without LoRA; a checkpoint whose
     names differ from the parameters', e.g. per-expert MoE files that transformers 5 fuses in memory,
     or a directory without safetensors): rank 0 runs the old whole build
     (:meth:`ModelAdapter.build_model`, fp32, the seeded adapter) and PyTorch's
     ``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)`` sends it one tensor
     at a time, each rank keeping its shard; buffers follow as one small object. The other ranks stay
     bounded; **rank 0 holds the whole model while it loads** (``model.build`` is for small models).

Why these. Measured: the per-rank read keeps every rank at its shard plus one tensor (the law test,
``tests/test_sharded_load.py``: 126 M parameters from bf16 files, growth per rank 136-142 MB at 4 ranks
and 261-278 MB at 2, against bounds of 184 and 305 MB; the old load grew each rank by 503 / 518 MB),
where rank 0 reading and scattering would hold the whole model on rank 0. Read, not measured:
PyTorch's own ``torch.distributed.checkpoint`` Hugging Face reader (``HuggingFaceStorageReader``) does
the same slicing but keeps each file mapped while it reads all of that file's requests (its
``read_data``) and casts file dtype -> fp32 directly, skipping ``model.dtype``'s rounding (not the old
bits); so the read is written here, in ~40 lines. ``broadcast_from_rank0`` is PyTorch's, used as is
where a whole build is needed anyway.

An adapter whose :meth:`~unirl.api.ModelAdapter.build_empty` returns None loads as before (the whole
model on every rank, then sharded).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from unirl.api import UniRLError, apply_lora, base_fingerprint, fingerprint

if TYPE_CHECKING:  # pragma: no cover
    from unirl_fsdp.worker import FSDPWorker

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointFilesError(UniRLError, ValueError):
    """``model.path``'s safetensors do not match the model built from its config."""


def checkpoint_files(path: str | None) -> dict[str, Path] | None:
    """Tensor name -> the safetensors file holding it, from ``model.safetensors.index.json`` or the one
    ``model.safetensors``; None when ``path`` is unset or holds neither."""
    if not path:
        return None
    root = Path(path)
    if (root / INDEX).is_file():
        weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    if (root / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(root / SINGLE), framework="pt") as f:
            return {name: root / SINGLE for name in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    return None


def _plain_names(model: torch.nn.Module) -> set[str]:
    """What must be read from the files: parameters (tied ones once) and persistent buffers."""
    persistent = {n for n, _ in model.named_buffers()} & set(model.state_dict())
    return {n for n, _ in model.named_parameters()} | persistent


def _wrap(worker: FSDPWorker, model: torch.nn.Module, *, trainable: bool) -> torch.nn.Module:
    """fp32 (free on meta), the seeded LoRA adapter, ``fully_shard``; then local shards on the device."""
    model = worker._prepare_model(model, device=None, trainable=trainable)
    lora = worker.config.actor.lora
    if lora is not None:
        model = apply_lora(model, lora, base_path=worker.config.model.path, seed=worker.config.run.seed)
    model = worker._wrap(model, trainable=trainable)
    offloaded = worker.options.cpu_offload and worker.device.type == "cuda"
    model.to_empty(device="cpu" if offloaded else worker.device)
    return model


def load_policy(worker: FSDPWorker, *, trainable: bool = True) -> torch.nn.Module:
    """The policy, sharded, its shards filled (module docstring); sets ``worker.lora_base`` with LoRA."""
    config = worker.config
    empty = worker.adapter.build_empty(config, worker.tokenizer)
    if empty is None:  # the adapter cannot build on meta: the whole model on every rank, as before
        return worker._shard(worker.adapter.build_model(config, worker.tokenizer), trainable=trainable)
    files = checkpoint_files(config.model.path)
    lazy = files is not None and _plain_names(empty) <= set(files)
    buffer_owners = _non_persistent_owners(empty) if lazy else []
    adapter = _seeded_adapter(worker, trainable) if lazy and config.actor.lora is not None else {}
    model = _wrap(worker, empty, trainable=trainable)
    if lazy:
        hf = model.get_base_model() if config.actor.lora is not None else model
        _init_buffers(hf, buffer_owners)
        _read_local_rows(hf, files, getattr(torch, config.model.dtype), adapter)
        if trainable and config.actor.lora is not None:
            worker.lora_base = _gathered_fingerprint(hf)
    else:
        fp = _from_rank0(worker, model)
        if trainable and config.actor.lora is not None:
            worker.lora_base = fp
    return model


def empty_like_policy(worker: FSDPWorker) -> torch.nn.Module:
    """A second sharded model like the policy, its shards allocated but not filled (the KL reference,
    which then copies the policy's shards and buffers); None when the adapter has no empty build."""
    empty = worker.adapter.build_empty(worker.config, worker.tokenizer)
    return None if empty is None else _wrap(worker, empty, trainable=False)


def _non_persistent_owners(model: torch.nn.Module) -> list[str]:
    """Names of the modules that own non-persistent buffers (no file holds those)."""
    persistent = set(model.state_dict())
    return sorted({n.rpartition(".")[0] for n, _ in model.named_buffers() if n not in persistent})


def _init_buffers(model: torch.nn.Module, owners: list[str]) -> None:
    """Compute the non-persistent buffers as ``from_pretrained`` does after its meta-device load:
    transformers' ``_init_weights`` on each module that owns one (before the parameters are read, so a
    parameter such a module also holds is then overwritten by the file's)."""
    with torch.no_grad():
        for owner in owners:
            model._init_weights(model.get_submodule(owner))


def _local_box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's part of ``t`` (a DTensor shard or a whole tensor) and where it sits in the whole."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, tuple(slice(0, n) for n in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _seeded_adapter(worker: FSDPWorker, trainable: bool) -> dict[str, torch.Tensor]:
    """The LoRA tensors ``apply_lora`` draws from ``run.seed``, whole (they are small), by their names in
    the HF model: peft draws them on the CPU and then moves them to the base layer's device, so on a
    meta base their values would be lost. Here the base is a twin whose every parameter is one CPU
    element expanded to its shape (no memory): the same modules in the same order, so the same draws."""
    config = worker.config
    twin = worker._prepare_model(worker.adapter.build_empty(config, worker.tokenizer), device=None,
                                 trainable=trainable)
    for module in twin.modules():
        for pname, p in list(module.named_parameters(recurse=False)):
            setattr(module, pname, torch.nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape),
                                                      requires_grad=p.requires_grad))
    twin = apply_lora(twin, config.actor.lora, base_path=config.model.path, seed=config.run.seed)
    return {n: p.detach().clone() for n, p in twin.get_base_model().named_parameters() if ".lora_" in n}


def _gathered_fingerprint(hf: torch.nn.Module) -> str:
    """:func:`unirl.api.base_fingerprint` of a sharded LoRA model: the same hash over the same names,
    each base tensor gathered whole in turn (a collective: every rank runs it)."""
    from torch.distributed.tensor import DTensor

    return fingerprint((n, t.full_tensor() if isinstance(t, DTensor) else t)
                       for n, t in hf.state_dict().items() if ".lora_" not in n)


def _read_local_rows(model: torch.nn.Module, files: dict[str, Path], dtype: torch.dtype,
                     adapter: dict[str, torch.Tensor]) -> None:
    """Fill every parameter's local shard (and every persistent buffer) from the files, one tensor at a
    time, through ``model.dtype`` to fp32; LoRA tensors from ``adapter``, base layers by their plain name."""
    from safetensors import safe_open

    persistent = set(model.state_dict())
    named = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in persistent)]
    with torch.no_grad():
        for key, t in named:
            local, box = _local_box(t.data if isinstance(t, torch.nn.Parameter) else t)
            if key in adapter:
                local.copy_(adapter[key][box])
                continue
            name = key.replace(".base_layer.", ".")
            with safe_open(str(files[name]), framework="pt") as f:
                part = f.get_slice(name)
                if tuple(part.get_shape()) != tuple(t.shape):
                    raise CheckpointFilesError(
                        f"model.path: {name} is {tuple(part.get_shape())} in {files[name].name}, but the model "
                        f"built from config.json has {tuple(t.shape)} (fix: a config.json that matches the weights)")
                if local.numel():
                    local.copy_(part[box].to(dtype).to(torch.float32))


def _from_rank0(worker: FSDPWorker, model: torch.nn.Module) -> str | None:
    """Rank 0 builds the whole model as the old path did; every rank receives its shards, tensor by
    tensor, and all buffers. Returns the LoRA base fingerprint (rank 0's, shared) or None."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    config = worker.config
    full: dict[str, torch.Tensor] = {}
    extra: list[Any] = [None, None]
    if worker.rank == 0:
        whole = worker.adapter.build_model(config, worker.tokenizer)
        whole = worker._prepare_model(whole, device=None, trainable=False)
        if config.actor.lora is not None:
            whole = apply_lora(whole, config.actor.lora, base_path=config.model.path, seed=config.run.seed)
            extra[1] = base_fingerprint(whole)
        full = whole.state_dict()
        extra[0] = {n: b.detach().clone() for n, b in whole.named_buffers()}
        del whole
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    dist.broadcast_object_list(extra, src=0)
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in extra[0].items():
            buffers[name].copy_(value)
    return extra[1]
