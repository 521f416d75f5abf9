"""The ``fsdp`` plugin's hooks. Imports neither torch nor Ray: listing plugins must stay cheap."""

from __future__ import annotations

import os
from typing import Any

from unirl.api import OptionsError, Violation, hookimpl

DIST = "unirl-fsdp"


@hookimpl
def unirl_actors():
    return {"fsdp": "unirl_fsdp.actor:FSDPActor"}


@hookimpl
def unirl_declarations():
    """The actor's Config, capabilities and memory layout without torch (``unirl plan`` reads these)."""
    return {"actors.fsdp": "unirl_fsdp.declaration:FSDPDeclaration"}


@hookimpl
def unirl_preflight(config: Any, kernel: Any) -> list[Violation]:
    """Catch a group that cannot be placed before Ray starts (it would wait for resources forever)."""
    if config.actor.name != "fsdp":
        return []
    out: list[Violation] = []
    try:  # the kernel's one validation against FSDPActor.Config (no second parse here)
        opts = kernel.options("actors", "fsdp", config.actor.options, "actor.options")
    except OptionsError:
        return out  # core preflight reports option errors against our Config, field by field, once
    local = not (opts.ray_address or os.environ.get("RAY_ADDRESS"))
    cpus = os.cpu_count() or 1
    if local and opts.device != "cuda" and opts.world_size * opts.cpus_per_rank > cpus:
        out.append(Violation(
            DIST, "actor.options.world_size",
            f"{opts.world_size} ranks x {opts.cpus_per_rank} CPUs exceed the {cpus} CPUs of this machine "
            "(the local Ray cluster could never place the group)",
            f"lower world_size or cpus_per_rank (e.g. cpus_per_rank: {cpus / opts.world_size:g}), "
            "or join a cluster with RAY_ADDRESS"))
    if opts.backend == "nccl" and opts.device == "cpu":
        out.append(Violation(DIST, "actor.options.backend", "nccl needs GPUs but device is cpu",
                             "use backend: gloo (or auto) on CPU"))
    if opts.cpu_offload and opts.device == "cpu":
        out.append(Violation(DIST, "actor.options.cpu_offload", "cpu_offload has nothing to offload on cpu",
                             "remove it, or set device: cuda"))
    per_step = config.trainer.prompts_per_step * config.rollout.n
    if per_step < opts.world_size:
        out.append(Violation(
            DIST, "actor.options.world_size",
            f"a step has {per_step} samples (prompts_per_step x rollout.n) for {opts.world_size} ranks: "
            "some ranks would only ever run empty micro-batches",
            "raise trainer.prompts_per_step or lower world_size"))
    return out
