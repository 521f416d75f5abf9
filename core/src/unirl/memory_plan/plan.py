"""The memory plan: every component's declared :class:`MemoryLayout`, summed per device, against a budget.

Why before launch: running out of memory is how most RL runs die, and they die late (after the engine
started and the model loaded). The actor and the engine each declare what they hold per device
(``memory_layout(config, options, facts)`` on their contract class); colocated loads (the same device
name) add up; each GPU is checked against its memory, and the host's processes together against the
host's. No model is built: the facts come from the model's config (:mod:`unirl.memory_plan.facts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from unirl.config import RunConfig
from unirl.contracts import Actor, RolloutEngine
from unirl.memory_plan.facts import model_facts
from unirl.memory_plan.layout import Fix, MemoryItem, MemoryLayout, ModelFacts

GB = 1 << 30
MB = 1 << 20


@dataclass
class DevicePlan:
    """One device's (or host process's) items from every component, their total and its budget."""

    device: str
    kind: str
    items: list[tuple[str, MemoryItem]] = field(default_factory=list)  # (component, item)
    budget: int | None = None

    @property
    def total(self) -> int:
        return sum(i.bytes for _, i in self.items)

    def largest(self, n: int = 3) -> list[MemoryItem]:
        return sorted((i for _, i in self.items), key=lambda i: -i.bytes)[:n]


@dataclass
class MemoryPlan:
    devices: list[DevicePlan]
    host_budget: int | None
    fixes: list[Fix]
    undeclared: list[str]  # components that declare no layout (their memory is not in the plan)

    @property
    def host_total(self) -> int:
        return sum(d.total for d in self.devices if d.kind == "host")

    def over(self) -> list[tuple[str, int, int]]:
        """(what, predicted, budget) for each device, and the host, over its budget."""
        out = [(d.device, d.total, d.budget) for d in self.devices
               if d.kind == "gpu" and d.budget is not None and d.total > d.budget]
        if self.host_budget is not None and self.host_total > self.host_budget:
            out.append(("host", self.host_total, self.host_budget))
        return out


def _component(kernel: Any, kind: str, name: str, raw: Any, at: str, contract: type) -> tuple[type, Any] | None:
    factory = kernel.declaration(kind, name)  # its light declaration where it registers one: no torch
    if not (isinstance(factory, type) and issubclass(factory, contract)):
        return None
    return factory, kernel.options(kind, name, raw, at, factory=factory)


def layouts(config: RunConfig, kernel: Any, facts: ModelFacts) -> tuple[list[tuple[str, MemoryLayout]], list[str]]:
    """Each selected component's declared layout, labelled; and the components that declare none."""
    out, undeclared = [], []
    for label, kind, name, raw, at, contract in (
            ("actor", "actors", config.actor.name, config.actor.options, "actor.options", Actor),
            ("engine", "rollout_engines", config.rollout.engine, config.rollout.options, "rollout.options",
             RolloutEngine)):
        resolved = _component(kernel, kind, name, raw, at, contract)
        layout = resolved[0].memory_layout(config, resolved[1], facts) if resolved else None
        if layout is None:
            undeclared.append(f"{label} {name!r}")
            continue
        out.append((label, layout))
        if any(load.kind == "gpu" for load in layout.loads):
            facts = replace(facts, accelerator=True)
    return out, undeclared


def detected_budgets(config: RunConfig, has_gpu: bool) -> tuple[int | None, int | None]:
    """(per-GPU budget, host budget) in bytes: ``run.memory_budget_gb`` (per GPU where the layout has
    GPUs, else the host's), else what this machine has (torch.cuda's device memory; the host's
    MemTotal). A GPU layout planned on a machine without one has no host figure either (it is not the
    machine it will run on)."""
    stated = int(config.run.memory_budget_gb * GB) if config.run.memory_budget_gb is not None else None
    cuda_total = _cuda_total() if has_gpu else None
    if has_gpu:
        return (stated if stated is not None else cuda_total), (_host_available() if cuda_total else None)
    return None, stated if stated is not None else _host_available()


def _cuda_total() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def _host_available() -> int | None:
    try:
        text = open("/proc/meminfo").read()
    except OSError:
        return None
    for line in text.splitlines():  # MemTotal, not MemAvailable: a layout that cannot fit the host at all
        if line.startswith("MemTotal:"):  # is refused; one that fits only after others exit is not
            return int(line.split()[1]) * 1024
    return None


def plan(config: RunConfig, kernel: Any, adapter: Any) -> MemoryPlan:
    """The plan of ``config``: the components' layouts summed per device, with budgets."""
    facts = model_facts(config, adapter)
    found, undeclared = layouts(config, kernel, facts)
    devices: dict[str, DevicePlan] = {}
    fixes: list[Fix] = []
    for label, layout in found:
        fixes += layout.fixes
        for load in layout.loads:
            dev = devices.setdefault(load.device, DevicePlan(load.device, load.kind))
            dev.items += [(label, i) for i in load.items]
    gpu_budget, host_budget = detected_budgets(config, any(d.kind == "gpu" for d in devices.values()))
    for d in devices.values():
        d.budget = gpu_budget if d.kind == "gpu" else None
    return MemoryPlan(list(devices.values()), host_budget, fixes, undeclared)


def gb(n: int | None) -> str:
    return "?" if n is None else f"{n / GB:.2f} GiB" if n >= GB else f"{n / MB:.1f} MiB"


def table(p: MemoryPlan) -> str:
    """The plan as text: per device, each item (component, bytes, how counted), total, budget, headroom."""
    lines = []
    for d in p.devices:
        budget = d.budget if d.kind == "gpu" else None
        head = f" budget {gb(budget)}, headroom {gb(budget - d.total)}" if budget is not None else ""
        lines.append(f"{d.device} ({d.kind}): total {gb(d.total)}{head}")
        lines += [f"  {comp:<6} {i.name:<30} {gb(i.bytes):>10}  {i.note}" for comp, i in d.items]
    host = [d for d in p.devices if d.kind == "host"]
    if host:
        budget = p.host_budget
        head = f", budget {gb(budget)}, headroom {gb(budget - p.host_total)}" if budget is not None else \
            ", budget ? (set run.memory_budget_gb)"
        lines.append(f"host (all {len(host)} process(es)): total {gb(p.host_total)}{head}")
    lines += [f"not in the plan: {u} declares no memory layout" for u in p.undeclared]
    lines.append("left out: each process's own runtime (Python, torch, Ray, CUDA context), fragmentation, data")
    return "\n".join(lines)


def with_override(config: RunConfig, dotted: str, value: Any) -> RunConfig:
    """``config`` with ``dotted=value`` applied, validated again (a fix's re-plan)."""
    data = config.model_dump()
    *parents, last = dotted.split(".")
    node = data
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[last] = value
    return RunConfig.model_validate(data)

