"""Trainer side of R3: the packed forward routes each response token to the experts the engine chose.

:class:`RouteReplay` holds forward hooks on the trainer model's routers for the life of the actor
(installed once, :func:`install`). Each packed forward first sets its plan (:meth:`RouteReplay.set`):
the recorded ids of every position of the packed row, :data:`NO_EXPERT` for prompt tokens, padding
and tokens without a record. In the hook, a position with a record takes the recorded ids, and its
gate weights are the router's own softmax at them (:func:`~unirl.routing.routers.gate_weights`), so
the router is trained through the experts the rollout used (arXiv 2510.11370); every other position
keeps the trainer's own choice.

Why hooks that outlive the forward: activation checkpointing recomputes the layers during the
backward, after the forward returned; the plan stays set until the next forward sets its own, so the
recompute routes as the forward did. The agreement counts are taken once per plan (the forward's, not
the recompute's).

``routing/agreement``: the share of (response token, sparse layer) decisions where the trainer's own
top-k set equals the recorded set, measured before the replay replaces it. Per layer, the share goes to
the ``unirl.routing`` logger at debug level.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from unirl.kernel.errors import ConfigError
from unirl.routing.record import routes_of
from unirl.routing.routers import NO_EXPERT, RouterSpec, gate_weights, routers_or_refuse

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.config import RunConfig
    from unirl.packing import PackedBatch
    from unirl.samples import Sample

log = logging.getLogger("unirl.routing")

#: each trainer model's replay (the module-level loss functions find it by the model they run)
_REPLAYS: weakref.WeakKeyDictionary[Any, RouteReplay] = weakref.WeakKeyDictionary()


class RouteReplay:
    """The replay hooks of one trainer model (see the module doc)."""

    def __init__(self, routers: Sequence[RouterSpec]) -> None:
        if not routers:
            raise ValueError("RouteReplay needs at least one router (a Mixture-of-Experts model)")
        self.routers = list(routers)
        self.plan: torch.Tensor | None = None  # [T, layers, k] long
        self.counts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (agree, recorded)
        self._handles = [r.module.register_forward_hook(self._hook(i, r)) for i, r in enumerate(self.routers)]

    def set(self, samples: Sequence[Sample], packed: PackedBatch) -> None:
        """The plan of one packed forward over ``samples`` (as :func:`unirl.packing.pack` laid them out)."""
        import torch

        T = packed.input_ids.shape[-1]
        plan = torch.full((T, len(self.routers), max(r.top_k for r in self.routers)), NO_EXPERT, dtype=torch.long)
        starts = packed.cu_seqlens.tolist()
        for s, start in zip(samples, starts, strict=False):
            if not s.response_ids:
                continue
            routes = routes_of(s)
            if routes is None:
                raise ConfigError(f"algorithm.routing_replay: sample {s.id} carries no recorded routing (its engine "
                                  "does not record expert ids); use rollout.engine: torch or set "
                                  "algorithm.routing_replay: false")
            at = start + len(s.prompt_ids)
            plan[at : at + routes.shape[0]] = torch.from_numpy(routes.astype("int64"))
        self.plan = plan.to(packed.input_ids.device)
        self.counts = {}

    def _hook(self, i: int, spec: RouterSpec):
        import torch

        def hook(module: Any, _args: tuple, output: tuple) -> tuple | None:
            plan = self.plan
            if module is not spec.module or plan is None:
                return None  # a copy of the model that inherited the hook, or no plan
            logits, _weights, ids = output
            if logits.shape[0] != plan.shape[0]:
                return None  # not the packed forward the plan was made for
            rec = plan[:, i, : ids.shape[-1]]
            has = rec[:, 0] >= 0
            if i not in self.counts:  # the forward's own routing, before replay (not a recompute's)
                same = (ids.sort(-1).values == rec.sort(-1).values).all(-1) & has
                self.counts[i] = (same.sum().detach(), has.sum().detach())
            use = torch.where(has[:, None], rec, ids)
            return logits, gate_weights(logits, use, spec.normalize), use

        return hook

    def agreement(self) -> tuple[float | None, list[float | None]]:
        """The last forward's agreement over all sparse layers, and per layer (None: nothing recorded)."""
        per: list[float | None] = []
        agree = total = 0
        for i in range(len(self.routers)):
            a, n = (int(x) for x in self.counts.get(i, (0, 0)))
            per.append(a / n if n else None)
            agree, total = agree + a, total + n
        return (agree / total if total else None), per

    def metrics(self, weight: torch.Tensor | float) -> dict[str, Any]:
        """``routing/agreement`` of the last forward, times ``weight`` (the micro-batch's share of the
        step's tokens: the metrics of a step are sums over micro-batches); per layer to the debug log."""
        overall, per = self.agreement()
        if overall is None:
            return {}
        if log.isEnabledFor(logging.DEBUG):
            log.debug("routing agreement per layer: %s",
                      " ".join(f"{r.layer}:{p:.4f}" for r, p in zip(self.routers, per, strict=True) if p is not None))
        return {"routing/agreement": overall * weight}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.plan = None


def install(config: RunConfig, adapter: Any, model: Any) -> RouteReplay | None:
    """The replay of ``model`` (built by ``adapter``) when ``algorithm.routing_replay`` is on (None when
    off), found again by :func:`replay_for`. A model without routers is refused naming the field."""
    if not config.algorithm.routing_replay:
        return None
    replay = _REPLAYS.get(model)
    if replay is None:
        replay = _REPLAYS[model] = RouteReplay(routers_or_refuse(config, adapter, model))
    return replay


def replay_for(model: Any) -> RouteReplay | None:
    """The replay :func:`install` put on ``model``, if any."""
    return _REPLAYS.get(model)


def prepare(model: Any, samples: Sequence[Sample], packed: PackedBatch) -> RouteReplay | None:
    """Set ``model``'s replay plan for its next forward over ``packed`` (``samples`` in packed order);
    None when ``model`` has no replay (R3 off, or a model that does not train: the KL reference)."""
    replay = _REPLAYS.get(model)
    if replay is not None:
        replay.set(samples, packed)
    return replay


def step_metrics(replay: RouteReplay | None, weight: Any) -> dict[str, Any]:
    """:meth:`RouteReplay.metrics` of the forward just run, {} without a replay."""
    return replay.metrics(weight) if replay is not None else {}
