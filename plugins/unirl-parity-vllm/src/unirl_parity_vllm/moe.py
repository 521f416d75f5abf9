"""The ``qwen3_moe`` parity provider: batch-invariant routing and a fixed-order expert combine.

Why: in a Mixture-of-Experts model a last-bit difference in a router logit can flip a top-k
decision and send a token through different experts; then rollout and replay disagree by far more
than rounding. So the router and the experts are computed by the same row-local code on every side
(this module is imported by the trainer, the embedded engine and, through
:mod:`unirl_parity_vllm.vllm_side.moe`, vLLM):

* :func:`route` - router logits ``ops.linear(x, gate.weight)`` (row-invariant), fp32 softmax over the
  experts (ATen's last-dim softmax reduces each row on its own; the row length is the fixed expert
  count), **top-k with a fixed tie-break** (a stable descending sort: of equal probabilities the lower
  expert index wins, never an implementation-defined order), and the weights renormalised over the
  selected experts (``norm_topk_prob``: the softmax restricted to them), summed in slot order;
* :func:`expert_combine` - every expert runs ``ops.linear`` -> ``ops.silu_and_mul`` -> ``ops.linear`` on
  the rows routed to it (a row's bits do not depend on which other rows share the expert: the GEMMs
  are row-invariant), each (token, slot) result is *written* to its own slot buffer (no scatter-add,
  so no accumulation order), and the slots are added left to right: slot 0 + slot 1 + ...

:class:`Qwen3MoePatches` installs these, plus the dense Qwen3 reference forwards, into transformers'
Qwen3-MoE classes. The router stays a module call (``self.gate(x)``) so transformers' output
recorder still captures ``router_logits`` (the auxiliary load-balancing loss reads them).

**Routing diagnostics** (:class:`RoutingRecorder`): while a recorder is active, every routed layer
appends its top-k expert ids; :func:`routing_stats` turns two recordings of the same tokens into the
mismatch fraction (tokens whose top-k *set* differs in any layer) and the expert load per layer.
Every step, under parity: the provider's ``exact_context("train")`` keeps a recorder open around each
micro-batch's forward, so the gate reads the replay's routing of exactly the tokens it checks; the
embedded engine's cached forwards (``Qwen3MoeForCausalLM.forward`` with a KV cache) file the ids of
each row's last position under its token-prefix hash (:mod:`unirl_parity_vllm.routing`), following
rows through ``Cache.batch_select_indices`` when finished rows leave the batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from unirl_parity_vllm.moe_ops import (  # noqa: F401 - re-exported: the math lives in the leaf moe_ops
    _ACTIVE,
    RoutingRecorder,
    _record,
    active,
    expert_combine,
    recording,
    route,
    routing_stats,
)
from unirl_parity_vllm.providers import (
    PatchSet,
    Qwen3ParityProvider,
    _as,
    attention_forward,
    embedding_forward,
    linear_forward,
    mlp_forward,
    rms_norm_forward,
)


# ------------------------------------------------------------------------------------------ transformers
def router_forward(self: Any, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``Qwen3MoeTopKRouter.forward`` on :func:`route` (same outputs: logits, weights, ids)."""
    x = hidden_states.reshape(-1, self.hidden_dim)
    return route(x, _as(self.weight, x), self.top_k, bool(self.norm_topk_prob))


def sparse_moe_forward(self: Any, hidden_states: Tensor) -> Tensor:
    """``Qwen3MoeSparseMoeBlock.forward``: the router module, then :func:`expert_combine`."""
    b, t, h = hidden_states.shape
    x = hidden_states.reshape(-1, h)
    _, weights, ids = self.gate(x)
    _record(self, ids, self.experts.gate_up_proj.shape[0])
    out = expert_combine(x, ids, weights, _as(self.experts.gate_up_proj, x), _as(self.experts.down_proj, x))
    return out.reshape(b, t, h)


# ------------------------------------------------------------------ the embedded engine's routing record
#: cache id -> the running prefix hash of each of its rows (the embedded engine's batch, in row order)
_ROWS: dict[int, list[int]] = {}
_ORIGINALS: dict[str, Any] = {}


def causal_lm_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``Qwen3MoeForCausalLM.forward``: unchanged, and with a KV cache (an engine's prefill or decode)
    the ids of each row's last position are filed under its prefix hash (module doc)."""
    from unirl_parity_vllm import routing

    original = _ORIGINALS["Qwen3MoeForCausalLM.forward"]
    cache, ids = kwargs.get("past_key_values"), kwargs.get("input_ids")
    if cache is None or ids is None or args or ids.ndim != 2:
        return original(self, *args, **kwargs)
    mask = kwargs.get("attention_mask")
    b, t = ids.shape
    fresh = cache.get_seq_length() == 0
    if fresh:
        _ROWS.pop(id(cache), None)
        while len(_ROWS) > 16:  # caches of finished batches (their ids may be reused: fresh resets)
            _ROWS.pop(next(iter(_ROWS)))
    prev = [0] * b if fresh else _ROWS.get(id(cache))
    keys = None
    if prev is not None and len(prev) == b:
        valid = mask[:, -t:].bool().tolist() if mask is not None else [[True] * t] * b
        keys = []
        for r, row in enumerate(ids.tolist()):
            h = prev[r]
            for tok, ok in zip(row, valid[r], strict=True):
                if ok:
                    h = routing.roll(h, tok)
            keys.append(h)
    with recording() as rec:
        out = original(self, *args, **kwargs)
    if keys is None:
        _ROWS.pop(id(cache), None)  # rows we cannot follow: record nothing for this cache
        return out
    _ROWS[id(cache)] = keys
    layers = rec.by_layer()
    if layers and all(v.shape[0] == b * t for v in layers.values()):
        last = torch.arange(b) * t + (t - 1)
        routing.SINK.add(keys, torch.stack([layers[k][last] for k in sorted(layers)], dim=1))
    return out


def cache_batch_select_indices(self: Any, indices: Tensor) -> Any:
    """``Cache.batch_select_indices``: the engine dropped finished rows; its row hashes follow."""
    out = _ORIGINALS["Cache.batch_select_indices"](self, indices)
    rows = _ROWS.get(id(self))
    if rows is not None:
        _ROWS[id(self)] = [rows[i] for i in indices.tolist()]
    return out


_qwen3_moe_attention_forward = attention_forward("qwen3_moe", qk_norm=True)


class Qwen3MoePatches(PatchSet):
    name = "qwen3_moe"

    def patches(self) -> list[tuple[Any, str, Any]]:
        from transformers import cache_utils
        from transformers.models.qwen3_moe import modeling_qwen3_moe as m

        for key, owner, attr, ours in (("Qwen3MoeForCausalLM.forward", m.Qwen3MoeForCausalLM, "forward",
                                        causal_lm_forward),
                                       ("Cache.batch_select_indices", cache_utils.Cache, "batch_select_indices",
                                        cache_batch_select_indices)):
            if owner.__dict__[attr] is not ours:
                _ORIGINALS[key] = owner.__dict__[attr]
        return [
            (m.Qwen3MoeForCausalLM, "forward", causal_lm_forward),
            (cache_utils.Cache, "batch_select_indices", cache_batch_select_indices),
            (torch.nn.Linear, "forward", linear_forward),
            (torch.nn.Embedding, "forward", embedding_forward),
            (m.Qwen3MoeRMSNorm, "forward", rms_norm_forward),
            (m.Qwen3MoeMLP, "forward", mlp_forward),
            (m.Qwen3MoeAttention, "forward", _qwen3_moe_attention_forward),
            (m.Qwen3MoeTopKRouter, "forward", router_forward),
            (m.Qwen3MoeSparseMoeBlock, "forward", sparse_moe_forward),
        ]


_QWEN3_MOE = Qwen3MoePatches()


class Qwen3MoeParityProvider(Qwen3ParityProvider):
    """``qwen3_moe``: the ``qwen3`` provider's contract with :class:`Qwen3MoePatches`; on vLLM the
    general plugin additionally installs :mod:`unirl_parity_vllm.vllm_side.moe`."""

    patch_set: PatchSet = _QWEN3_MOE

    @contextlib.contextmanager
    def exact_context(self, phase: str) -> Iterator[None]:
        """The ``qwen3`` context; around a training micro-batch (``"train"``) also a routing
        recorder, which the parity gate reads (the replay's routing of the tokens it checks)."""
        with super().exact_context(phase):
            if phase == "train":
                with recording():
                    yield
            else:
                yield


def installed() -> bool:
    return _QWEN3_MOE.installed


__all__ = ["Qwen3MoeParityProvider", "Qwen3MoePatches", "RoutingRecorder", "active", "expert_combine", "recording",
           "route", "routing_stats"]
