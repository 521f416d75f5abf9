"""The embedded actor's declared memory (:meth:`unirl.contracts.Actor.memory_layout`): one rank of the
shared arithmetic, whole model, in the trainer's process (it runs on the CPU unless given a device)."""

from __future__ import annotations

from typing import Any

from unirl.config import RunConfig
from unirl.memory_plan.arithmetic import RankShape, actor_items
from unirl.memory_plan.layout import DeviceLoad, MemoryLayout, ModelFacts


def torch_actor_layout(cls: type, config: RunConfig, options: Any, facts: ModelFacts) -> MemoryLayout:
    dtype = cls.capabilities(config, options).compute_dtype or "float32"  # one source: its declaration
    state, work = actor_items(config, facts, RankShape(ranks=1, compute_dtype=dtype))
    return MemoryLayout((DeviceLoad("trainer", "host", tuple(state + work)),))
