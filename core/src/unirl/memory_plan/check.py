"""Preflight's memory check: a device whose predicted peak exceeds its budget fails the run before Ray
starts, naming the device, predicted and available bytes, the largest items and the fixes (re-planned).

Registered as core's own ``unirl_preflight`` implementation (:mod:`unirl.builtins` imports
:func:`unirl_preflight`), so it runs with every other preflight check, in one report.
``run.memory_check``: ``error`` (default) refuses, ``warn`` prints the same line and goes on, ``off``
skips the plan.
"""

from __future__ import annotations

import sys
from typing import Any

from unirl.kernel.errors import OptionsError, PluginError, Violation
from unirl.kernel.hookspecs import hookimpl

CORE = "unirl-core"


def memory_violations(config: Any, kernel: Any, adapter: Any) -> list[Violation]:
    """One violation per device (and the host) over budget, each naming its fixes."""
    from unirl.memory_plan.fixes import describe, effects
    from unirl.memory_plan.plan import gb, plan

    p = plan(config, kernel, adapter)
    over = p.over()
    if not over:
        return []
    fixes = effects(config, kernel, adapter, p)
    named = "; ".join(describe(e) for e in fixes) or "none of the known fixes is enough: a larger device or more devices"
    out = []
    devices = {d.device: d for d in p.devices}
    groups: dict[tuple[int, int], list[str]] = {}  # devices with the same peak and budget: one line
    for what, total, budget in over:
        groups.setdefault((total, budget), []).append(what)
    for (total, budget), names in groups.items():
        what = ", ".join(names) + (" (each)" if len(names) > 1 else "")
        dev = devices.get(names[0])
        items = dev.largest() if dev else sorted((i for d in p.devices if d.kind == "host" for _, i in d.items),
                                                 key=lambda i: -i.bytes)[:3]
        largest = ", ".join(f"{i.name} {gb(i.bytes)}" for i in items)
        msg = (f"{what}: predicted peak {gb(total)} ({total:,} B) exceeds the {gb(budget)} ({budget:,} B) "
               f"available (largest: {largest}; `unirl plan` prints every item)")
        out.append(Violation(CORE, "run.memory_check", msg, f"apply one of: {named}; or set run.memory_budget_gb, "
                             "or run.memory_check: warn|off"))
    return out


@hookimpl
def unirl_preflight(config: Any, adapter: Any, kernel: Any) -> list[Violation]:
    """The memory plan's refusals (``run.memory_check``); nothing when the components do not resolve
    (their own checks report that) or there is no model adapter."""
    mode = config.run.memory_check
    if mode in ("off", False) or adapter is None:
        return []
    try:
        found = memory_violations(config, kernel, adapter)
    except (PluginError, OptionsError, OSError, ValueError):  # each reported by its own check
        return []
    if mode == "warn":
        for v in found:
            print(f"warning: memory plan: {v}", file=sys.stderr)
        return []
    return found
