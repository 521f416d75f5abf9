"""The vLLM parity adapters in force: the built-in ones and the ``unirl_parity.vllm_adapters`` entry points.

Why its own module: the MoE adapter (:mod:`unirl_parity_vllm.vllm_side.moe`) subclasses
:class:`~unirl_parity_vllm.vllm_side.adapters.VLLMAdapter`, so listing it from ``adapters`` made the two
import each other. The installer reads the list from here.
"""

from __future__ import annotations

import importlib.metadata as md

from unirl_parity_vllm.vllm_side.adapters import (
    ENTRY_POINT_GROUP,
    VLLMAdapter,
    _qwen3_checks,
    model_init_adapter,
)
from unirl_parity_vllm.vllm_side.moe import qwen3_moe_adapter


def builtin_adapters() -> list[VLLMAdapter]:
    return [model_init_adapter("qwen3", "vllm.model_executor.models.qwen3", "Qwen3ForCausalLM",
                               checks=[_qwen3_checks]), qwen3_moe_adapter()]


def discovered_adapters() -> tuple[list[VLLMAdapter], list[str]]:
    """Built-in adapters plus the ``unirl_parity.vllm_adapters`` entry points (and their load errors)."""
    adapters = builtin_adapters()
    problems: list[str] = []
    for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            made = ep.load()()
        except Exception as exc:  # noqa: BLE001 - a broken third-party adapter is a violation, not a crash
            problems.append(f"adapter entry point {ep.name} ({ep.value}) failed: {type(exc).__name__}: {exc}")
            continue
        if not isinstance(made, VLLMAdapter):
            problems.append(f"adapter entry point {ep.name} returned {type(made).__name__}, not a VLLMAdapter")
            continue
        if any(a.name == made.name for a in adapters):
            problems.append(f"adapter entry point {ep.name}: adapter name {made.name!r} is taken")
            continue
        adapters.append(made)
    return adapters, problems
