"""An actor's weights in Hugging Face form: named as ``save_pretrained`` names them, and written as an HF
directory (config + safetensors + tokenizer) atomically.

Why a module of its own: the embedded actor, every FSDP rank and the tiny judge's builder export the same
way, and none of that is the actor skeleton's training math. Re-exported by :mod:`unirl.actor.skeleton`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from unirl.actor.checkpoint import staging_dir


def hf_named_weights(model: torch.nn.Module, *, local: Callable[[Tensor], Tensor] | None = None
                     ) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` of the model's state dict in HF names, each storage once.

    Tied weights (``lm_head.weight`` sharing ``model.embed_tokens.weight``) are yielded once, under the
    first name in state-dict order, which is what ``save_pretrained`` writes (it drops the tied
    ``lm_head.weight``; the loader re-ties from ``tie_word_embeddings``). Tensors are detached views of
    the live weights (no copy): consume them before the next optimizer step. ``local`` maps a sharded
    tensor to the local shard used to recognise shared storage (FSDP: ``DTensor.to_local``).
    """
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, t in model.state_dict().items():
        here = local(t) if local is not None else t
        key = (here.data_ptr(), tuple(t.shape))
        if here.numel() and key in seen:
            continue
        seen.add(key)
        yield name, t.detach()


def write_hf_dir(path: str, model: torch.nn.Module, tokenizer: Any = None,
                 state_dict: Mapping[str, Tensor] | None = None) -> None:
    """``save_pretrained`` (safetensors, tied weights once) + tokenizer into ``path``, atomically.

    With ``state_dict`` (a gathered full state of a wrapped model), a shell of the plain HF class is
    built on the meta device and saves it: the wrapper would name its own class in
    ``config.architectures``."""
    with staging_dir(path) as tmp:
        if state_dict is None:
            model.save_pretrained(str(tmp))
        else:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                shell = AutoModelForCausalLM.from_config(model.config)
            shell.save_pretrained(str(tmp), state_dict=dict(state_dict))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
