"""The fixes a refused plan names, each with its predicted effect: re-planned, not guessed.

Why re-plan: "use more ranks" is advice; "actor.options.world_size=8: gpu:0 158 GB -> 42 GB, fits" is a
fix. Candidates come from two places: the components' declared :class:`~unirl.memory_plan.layout.Fix`
(more ranks, CPU offload: only the actor that has them declares them) and the actor settings every actor
reads (activation checkpointing, a smaller micro-batch, LoRA). Each is applied to the config, the plan is
made again, and the fix is named with the new peak; fixes of one field are alternatives (the first that
fits is named, else the one that helps most).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unirl.config import RunConfig
from unirl.memory_plan.layout import Fix
from unirl.memory_plan.plan import MemoryPlan, gb, plan, with_override


@dataclass(frozen=True)
class Effect:
    fix: Fix
    worst: int  # the largest over-budget predicted total after the fix (0: it fits)
    fits: bool
    peak: str  # the new peak of what was over, in words


def candidates(config: RunConfig, declared: list[Fix]) -> list[Fix]:
    """Declared fixes, then the actor settings every actor reads."""
    a = config.actor
    out = list(declared)
    if a.activation_checkpointing is not True:
        out.append(Fix("actor.activation_checkpointing", True, "recompute each layer in backward"))
    for smaller in sorted({max(1, a.micro_batch_size // 4), max(1, a.micro_batch_size // 2)}):
        if smaller < a.micro_batch_size:
            out.append(Fix("actor.micro_batch_size", smaller, "fewer sequences per forward/backward"))
    if a.lora is None:
        out.append(Fix("actor.lora", {"r": 16}, "train a LoRA adapter: no full gradients or AdamW state"))
    return out


def _effect(fix: Fix, config: RunConfig, kernel: Any, adapter: Any, before: MemoryPlan) -> Effect | None:
    try:
        after = plan(with_override(config, fix.field, fix.value), kernel, adapter)
    except Exception:  # noqa: BLE001 - a fix that does not validate under this config is not offered
        return None
    names = {what for what, _, _ in before.over()}
    totals = {d.device: d.total for d in after.devices} | {"host": after.host_total}
    worst = max((t for what, t, _ in after.over()), default=0)
    peak = f"peak {gb(max(totals.get(what, 0) for what in names))}"
    return Effect(fix, worst, not after.over(), peak)


def effects(config: RunConfig, kernel: Any, adapter: Any, before: MemoryPlan) -> list[Effect]:
    """Each field's best candidate that helps, fitting ones first."""
    worst_before = max(t for _, t, _ in before.over())
    best: dict[str, Effect] = {}
    for fix in candidates(config, before.fixes):
        e = _effect(fix, config, kernel, adapter, before)
        if e is None or e.worst >= worst_before and not e.fits:
            continue
        held = best.get(fix.field)
        if held is None or (not held.fits and (e.fits or e.worst < held.worst)):
            best[fix.field] = e
    return sorted(best.values(), key=lambda e: (not e.fits, e.worst))


def describe(e: Effect) -> str:
    value = e.fix.value
    if isinstance(value, bool):
        value = str(value).lower()
    elif isinstance(value, dict):  # as an override reads it: actor.lora={r: 16}
        value = "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    verdict = "fits" if e.fits else "still over"
    return f"{e.fix.field}={value} ({e.fix.what}: {e.peak}, {verdict})"
