"""What the routing record and replay need to know about a model's routers, declared by its adapter.

Why a declaration and not a search of the module tree: which module routes, and how its gate weights
follow from its logits, is the model family's knowledge; the adapter (``Qwen3MoeAdapter.routers``)
states it, and the record and replay stay family-free.

The router contract: a module whose forward returns ``(logits [tokens, E], weights [tokens, k],
ids [tokens, k])`` over the flattened tokens of its input, the weights being the softmax over all E
experts gathered at the top-k ids, renormalised over those k when ``normalize`` (transformers'
Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral routers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from unirl.kernel.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.config import RunConfig

#: the id stored for a token with no recorded routing (a prompt, an observation, the last sampled token)
NO_EXPERT = -1


@dataclass(frozen=True)
class RouterSpec:
    """One sparse layer's router: the module, its decoder layer index, top-k, expert count, and
    whether its top-k weights are renormalised (``norm_topk_prob``)."""

    module: torch.nn.Module
    layer: int
    top_k: int
    num_experts: int
    normalize: bool


def gate_weights(logits: torch.Tensor, ids: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The router's own gate weights at the experts ``ids [tokens, k]``: softmax over all experts in
    fp32, gathered at ``ids``, renormalised over them when ``normalize``; in the logits' dtype.

    Under replay ``ids`` are the recorded experts, so the weights are the trainer's softmax over the
    experts the engine chose and the gradient reaches the router through them (R3, arXiv 2510.11370:
    with ``normalize`` this is exactly the softmax of the logits masked to the recorded experts)."""
    import torch

    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w = probs.gather(-1, ids)
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


def routers_or_refuse(config: RunConfig, adapter: Any, model: Any) -> list[RouterSpec]:
    """``adapter.routers(model)``, refused in one line naming the field when there are none (a dense
    model has nothing to replay)."""
    routers = adapter.routers(model)
    if not routers:
        raise ConfigError(f"algorithm.routing_replay: true needs a Mixture-of-Experts model; model.adapter "
                          f"'{config.model.adapter}' built one with no routers (use model.adapter: qwen3_moe, or "
                          "set algorithm.routing_replay: false)")
    return routers
