"""The memory plan (``unirl plan``, and preflight's memory check): see :mod:`unirl.memory_plan.plan`."""

from __future__ import annotations

from typing import Any

from unirl.memory_plan.layout import DeviceLoad, Fix, MemoryItem, MemoryLayout, ModelFacts

__all__ = ["DeviceLoad", "Fix", "MemoryItem", "MemoryLayout", "ModelFacts", "plan_recipe"]


def plan_recipe(recipe: str, overrides: list[str] | None = None) -> Any:
    """The :class:`~unirl.memory_plan.plan.MemoryPlan` of a recipe file with overrides (the CLI's and the
    benchmark's entry)."""
    from unirl.config import load_config
    from unirl.kernel.manager import load_kernel
    from unirl.memory_plan.plan import plan

    config = load_config(recipe, overrides or [])
    kernel = load_kernel()
    adapter = kernel.get("model_adapters", config.model.adapter).load()()
    return plan(config, kernel, adapter)
