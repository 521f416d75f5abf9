"""A probe rank for R3 on the FSDP actor: what each sparse layer's router hands the experts, on the rank.

Why a rank-side probe: the FSDP forward runs in Ray actors, so the driver cannot hook the routers. The
probe hooks them after the replay's own hook (forward hooks run in registration order, each seeing the
output the one before returned), so it sees the expert ids the experts actually get. Select it with
``actor.options.worker_cls: "r3_probe:R3ProbeWorker"`` (this directory on ``sys.path``)."""

from __future__ import annotations

from typing import Any

import fsdp_support  # the drill worker this probe extends

from unirl.api import Sample

fsdp_support.on_path()


class R3ProbeWorker(fsdp_support.DrillWorker):
    """:class:`fsdp_support.DrillWorker` plus :meth:`replayed_experts`."""

    def replayed_experts(self, samples: list[Sample], num_micro: int) -> list[dict[str, Any]]:
        """Per packed forward of a log-prob replay over ``samples``: the ids each router passed on
        (``[T, layers, k]``) and the replay's plan for that forward (``NO_EXPERT`` where none)."""
        import torch

        from unirl.routing import replay_for

        replay = replay_for(self.model)
        if replay is None:
            raise RuntimeError("R3 is off on this rank (algorithm.routing_replay: false)")
        forwards: list[dict[str, Any]] = []
        per_layer: list[torch.Tensor] = []
        plan: list[torch.Tensor | None] = [None]

        def flush() -> None:
            if per_layer:
                forwards.append({"ids": torch.stack(per_layer, 1), "plan": plan[0]})
                per_layer.clear()

        def begin(_m: Any, _a: tuple) -> None:  # the first router of a forward: its plan is set by now
            flush()
            plan[0] = replay.plan.detach().cpu().clone() if replay.plan is not None else None

        def seen(_m: Any, _a: tuple, out: tuple) -> None:
            per_layer.append(out[2].detach().cpu().clone())

        handles = [r.module.register_forward_hook(seen) for r in replay.routers]
        handles.append(replay.routers[0].module.register_forward_pre_hook(begin))
        try:
            self.logprobs(samples, num_micro)
        finally:
            for h in handles:
                h.remove()
        flush()
        return forwards
