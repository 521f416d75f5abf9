"""The MoE reference math and the routing recorder, shared by the training side (:mod:`unirl_parity_vllm.moe`)
and the vLLM side (:mod:`unirl_parity_vllm.vllm_side.moe`).

Why a leaf: the vLLM side needs only this math, but importing it from ``moe`` (which holds the training
provider, built on ``providers``) closed a circle, providers -> vllm_side -> installer -> adapters ->
vllm_side.moe -> moe -> providers. This module imports only torch and :mod:`unirl_parity_vllm.ops`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from unirl_parity_vllm import ops


# ------------------------------------------------------------------------------------------ shared math
def route(x: Tensor, gate_weight: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``x [N, H]`` -> ``(logits [N, E], weights [N, k], ids [N, k])``; row-invariant (module doc)."""
    logits = ops.linear(x, gate_weight)
    probs = torch.softmax(logits.float(), dim=-1)
    order = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices
    ids = order[:, :top_k]
    top = probs.gather(-1, ids)
    if renormalize:
        den = top[:, :1]
        for j in range(1, top_k):  # slot order, not a reduction kernel's
            den = den + top[:, j:j + 1]
        top = top / den
    return logits, top.to(x.dtype), ids


def expert_combine(x: Tensor, ids: Tensor, weights: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """``sum_j weights[:, j] * expert_{ids[:, j]}(x)`` in slot order ``j = 0, 1, ...``.

    ``w13 [E, 2I, H]`` (gate rows first, then up: transformers' ``gate_up_proj`` and vLLM's
    ``w13_weight``), ``w2 [E, H, I]``. Differentiable (weights and both expert tensors)."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    slots: list[Tensor] = [x.new_zeros((n, x.shape[-1])) for _ in range(k)]
    if n:
        for e in torch.unique(flat).tolist():
            rows, slot = torch.nonzero(ids == e, as_tuple=True)
            h = ops.linear(x.index_select(0, rows), w13[e])
            y = ops.linear(ops.silu_and_mul(h), w2[e]) * weights[rows, slot, None]
            for j in range(k):
                sel = slot == j
                if bool(sel.any()):
                    slots[j] = slots[j].index_put((rows[sel],), y[sel])
    out = slots[0]
    for j in range(1, k):
        out = out + slots[j]
    return out


# ------------------------------------------------------------------------------------------ diagnostics
class RoutingRecorder:
    """Top-k expert ids of every routed layer call, in call order, while :func:`recording`.

    A layer is told apart by its sparse block (module identity); :meth:`by_layer` numbers the blocks
    in the order they first ran, which is the decoder-layer order of a forward."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, Tensor]] = []
        self._order: dict[int, int] = {}
        self.num_experts = 0

    def add(self, block: Any, ids: Tensor, num_experts: int = 0) -> None:
        layer = self._order.setdefault(id(block), len(self._order))
        self.calls.append((layer, ids.detach().to("cpu", copy=True)))
        self.num_experts = max(self.num_experts, int(num_experts))

    def by_layer(self) -> dict[int, Tensor]:
        """Each layer's ids of all its calls, concatenated in call order ``[tokens, k]``."""
        out: dict[int, list[Tensor]] = {}
        for layer, ids in self.calls:
            out.setdefault(layer, []).append(ids)
        return {layer: torch.cat(v) for layer, v in sorted(out.items())}


_ACTIVE = threading.local()


@contextlib.contextmanager
def recording() -> Iterator[RoutingRecorder]:
    """Record the routing of every parity MoE forward run in this thread inside the block."""
    rec = RoutingRecorder()
    prev = getattr(_ACTIVE, "rec", None)
    _ACTIVE.rec = rec
    try:
        yield rec
    finally:
        _ACTIVE.rec = prev


def active() -> RoutingRecorder | None:
    """The recorder of the innermost :func:`recording` block of this thread (None outside one)."""
    return getattr(_ACTIVE, "rec", None)


def _record(block: Any, ids: Tensor, num_experts: int = 0) -> None:
    rec = getattr(_ACTIVE, "rec", None)
    if rec is not None:
        rec.add(block, ids, num_experts)


def routing_stats(a: dict[int, Tensor], b: dict[int, Tensor], num_experts: int,
                  mask: Tensor | None = None) -> dict[str, Any]:
    """Compare two routings of the same tokens (``layer -> [N, k]``), over ``mask`` rows when given.

    ``mismatch_tokens``: tokens whose top-k expert *set* differs in at least one layer;
    ``expert_load``: per layer, the fraction of (token, slot) assignments each expert got in ``a``."""
    if sorted(a) != sorted(b):
        raise ValueError(f"routings cover different layers: {sorted(a)} vs {sorted(b)}")
    differs = None
    load = {}
    for layer in sorted(a):
        x, y = a[layer], b[layer]
        if x.shape != y.shape:
            raise ValueError(f"layer {layer}: routing shapes differ {tuple(x.shape)} vs {tuple(y.shape)}")
        if mask is not None:
            x, y = x[mask], y[mask]
        d = (x.sort(-1).values != y.sort(-1).values).any(-1)
        differs = d if differs is None else differs | d
        counts = torch.bincount(x.reshape(-1), minlength=num_experts).double()
        load[str(layer)] = [round(float(c), 6) for c in (counts / max(1.0, float(counts.sum()))).tolist()]
    n = int(differs.numel()) if differs is not None else 0
    bad = int(differs.sum()) if differs is not None else 0
    return {"tokens": n, "mismatch_tokens": bad, "mismatch_fraction": bad / n if n else 0.0, "expert_load": load}
