"""Preflight: find every problem in a run config before anything expensive starts.

Core checks the things it owns (are the selected components registered, do their ``options``
validate against the plugin's ``Config`` model, do the pieces fit together) and then asks every
plugin's ``unirl_preflight`` hook. All violations come back in one report, so a recipe is fixed in one
pass rather than one crash at a time, and nothing is lost: no Ray cluster, no model, no run directory
has been touched yet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from unirl.config import RunConfig
from unirl.kernel.errors import PluginError, PreflightError, Violation
from unirl.kernel.manager import Kernel

CORE = "unirl-core"

#: (registry kind, field holding the name, field holding the options or None)
SELECTIONS: tuple[tuple[str, str, str | None], ...] = (
    ("model_adapters", "model.adapter", None),
    ("rollout_engines", "rollout.engine", "rollout.options"),
    ("actors", "actor.name", "actor.options"),
    ("weight_syncs", "weight_sync.name", "weight_sync.options"),
    ("advantage_estimators", "algorithm.estimator", None),
    ("policy_losses", "algorithm.loss", None),
    ("rewards", "reward.name", None),
)


def _get(config: RunConfig, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def options_model(factory: Any) -> type[BaseModel] | None:
    """The pydantic model a component declares for its ``options`` (a ``Config`` attribute)."""
    model = getattr(factory, "Config", None)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _check_selection(kernel: Kernel, config: RunConfig, kind: str, field: str, opt_field: str | None) -> list[Violation]:
    name = _get(config, field)
    try:
        entry = kernel.get(kind, name)
    except PluginError as exc:
        return [Violation(CORE, field, str(exc), f"pick one of: {', '.join(kernel.names(kind)) or 'none'}")]
    try:
        factory = entry.load()
    except PluginError as exc:
        return [Violation(entry.dist, field, str(exc), f"reinstall {entry.dist}, or pick another {kind}")]
    if opt_field is None:
        return []
    options = _get(config, opt_field)
    model = options_model(factory)
    if model is None:
        if options:
            return [Violation(entry.dist, opt_field, f"'{name}' takes no options, got {sorted(options)}",
                              "remove them")]
        return []
    try:
        model.model_validate(options)
    except ValidationError as exc:
        out = []
        for err in exc.errors():
            where = ".".join([opt_field, *map(str, err["loc"])])
            known = ", ".join(model.model_fields)
            out.append(Violation(entry.dist, where, err["msg"], f"options of '{name}': {known}"))
        return out
    return []


def core_violations(config: RunConfig, kernel: Kernel) -> list[Violation]:
    out: list[Violation] = []
    for kind, field, opt_field in SELECTIONS:
        out += _check_selection(kernel, config, kind, field, opt_field)
    for i, name in enumerate(config.algorithm.modifiers):
        try:
            kernel.get("loss_modifiers", name)
        except PluginError as exc:
            out.append(Violation(CORE, f"algorithm.modifiers[{i}]", str(exc), "install the plugin or remove it"))
    a, r = config.algorithm, config.rollout
    if a.estimator in ("grpo", "dr_grpo", "rloo") and r.n < 2:
        out.append(Violation(CORE, "rollout.n", f"{a.estimator} needs at least 2 samples per prompt, got {r.n}",
                             "set rollout.n >= 2 (8 is typical)"))
    if a.estimator == "gae" and not config.actor.value_head:
        out.append(Violation(CORE, "actor.value_head", "estimator 'gae' needs a value head",
                             "set actor.value_head: true"))
    if a.clip_high < a.clip_low:
        out.append(Violation(CORE, "algorithm.clip_high", f"{a.clip_high} < clip_low {a.clip_low}",
                             "clip-higher means clip_high >= clip_low"))
    for field in ("data.source", "data.eval_source"):
        src = _get(config, field)
        if src and src != "arith" and not Path(src).is_file():
            out.append(Violation(CORE, field, f"dataset file {src} does not exist",
                                 "give a .jsonl/.parquet path, or 'arith' for the built-in task"))
    if config.model.path and not Path(config.model.path).is_dir():
        out.append(Violation(CORE, "model.path", f"model directory {config.model.path} does not exist",
                             "point it at a local HF directory, or unset it to build a tiny model"))
    return out


def plugin_violations(config: RunConfig, kernel: Kernel) -> list[Violation]:
    out: list[Violation] = []
    for dist, answer in _safe_calls(kernel, "unirl_preflight", config):
        if isinstance(answer, Violation):
            answer = [answer]
        if answer is None:
            continue
        if not isinstance(answer, list) or not all(isinstance(v, Violation) for v in answer):
            out.append(Violation(dist, "unirl_preflight", f"hook returned {type(answer).__name__}, "
                                 "not a list of Violation", "fix the plugin (a bug, not your config)"))
            continue
        out += answer
    return out


def _safe_calls(kernel: Kernel, hook: str, config: RunConfig) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    caller = getattr(kernel.hook, hook)
    for impl in reversed(caller.get_hookimpls()):
        dist = kernel.dist_of(impl.plugin_name)
        try:
            out.append((dist, impl.function(config=config)))
        except Exception as exc:  # noqa: BLE001 - a broken check is itself a violation
            out.append((dist, [Violation(dist, hook, f"raised {type(exc).__name__}: {exc}", "report to the plugin")]))
    return out


def preflight(config: RunConfig, kernel: Kernel) -> list[Violation]:
    """Every violation from core and from every plugin, in one list."""
    return core_violations(config, kernel) + plugin_violations(config, kernel)


def check(config: RunConfig, kernel: Kernel) -> None:
    violations = preflight(config, kernel)
    if violations:
        raise PreflightError(violations)


def worker_env(config: RunConfig, kernel: Kernel) -> dict[str, str]:
    """Merge every plugin's ``unirl_worker_env``; a variable set two ways is an error naming both."""
    merged: dict[str, str] = {}
    owner: dict[str, str] = {}
    for dist, answer in kernel.call_each("unirl_worker_env", config=config):
        if not answer:
            continue
        if not isinstance(answer, dict):
            raise PluginError(f"{dist}: unirl_worker_env returned {type(answer).__name__}, not a dict")
        for key, value in answer.items():
            value = str(value)
            if key in merged and merged[key] != value:
                raise PluginError(f"worker env {key} is set to {merged[key]!r} by {owner[key]} and to "
                                  f"{value!r} by {dist}")
            merged[key], owner[key] = value, dist
    return merged
