"""Activation checkpointing for the actor's model: ``actor.activation_checkpointing``.

``true`` (full) keeps only each decoder layer's input and recomputes the whole layer in backward: the
least memory, one more forward's worth of matmuls per step. ``selective`` recomputes the layer too, but
keeps the outputs of its matmuls and of its attention (torch's selective activation checkpointing,
``create_selective_checkpoint_contexts``), so backward re-runs only the cheap element-wise ops (norms,
rotary, activation function). Why it exists: on CPU the recomputed matmuls are most of what full
checkpointing costs, while the element-wise outputs (many of them fp32 under bf16 autocast: the norms)
are a large part of what a layer would keep; TorchTitan's "op" selective AC makes the same trade.
Measured (docs/operations.md, "Selective activation checkpointing"): at 100 M x 64 bf16 on 2 CPU cores, with
``actor.micro_batch_tokens: 1024``, the train phase took 13.1-13.5 s against full's 15.2-16.8 s at 4096
tokens, at a peak RSS of 3,655 MB against 4,445 MB.

The gradient is the same as without checkpointing: the saved outputs are the ones the forward computed.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from unirl.config import CheckpointingMode

#: the ops whose outputs a selective checkpoint keeps: matmuls, and attention on each backend torch
#: dispatches SDPA to (CPU flash, CUDA flash / memory-efficient / cuDNN); an op this torch lacks is skipped
_SAVED_NAMES = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention")
SAVED_OPS = frozenset(getattr(torch.ops.aten, n).default for n in _SAVED_NAMES if hasattr(torch.ops.aten, n))


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def enable(model: torch.nn.Module, mode: CheckpointingMode) -> None:
    """Turn on ``mode`` for a transformers model (``gradient_checkpointing_enable``, non-reentrant, which
    selective checkpointing needs); ``False`` leaves the model as it is."""
    if not mode:
        return
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
