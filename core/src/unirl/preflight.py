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

from unirl.algorithms.losses import metric_reduce_of
from unirl.config import RunConfig
from unirl.contracts import (
    Actor,
    EngineCapabilities,
    EstimatorTraits,
    RolloutController,
    RolloutEngine,
    TraceExporter,
    WeightSync,
    traits_of,
)
from unirl.data.datasets import data_violations
from unirl.kernel.errors import PluginError, PreflightError, Violation
from unirl.kernel.manager import Kernel
from unirl.rewards.build import reward_violations

CORE = "unirl-core"

#: (registry kind, field holding the name, field holding the options or None)
SELECTIONS: tuple[tuple[str, str, str | None], ...] = (
    ("model_adapters", "model.adapter", None),
    ("rollout_engines", "rollout.engine", "rollout.options"),
    ("actors", "actor.name", "actor.options"),
    ("weight_syncs", "weight_sync.name", "weight_sync.options"),
    ("advantage_estimators", "algorithm.estimator", "algorithm.estimator_options"),
    ("policy_losses", "algorithm.loss", "algorithm.loss_options"),
    ("rewards", "reward.name", None),
)

#: optional selections: checked only when set
OPTIONAL_SELECTIONS: tuple[tuple[str, str, str | None], ...] = (
    ("environments", "rollout.environment", None),
    ("rollout_controllers", "rollout.controller", None),
    ("trace_exporters", "trace.exporter", "trace.options"),
)


#: the contract class a registry's factories must subclass (function registries have none)
CONTRACTS: dict[str, type] = {
    "rollout_engines": RolloutEngine,
    "actors": Actor,
    "weight_syncs": WeightSync,
    "trace_exporters": TraceExporter,
    "rollout_controllers": RolloutController,
}


def _get(config: RunConfig, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def options_model(factory: Any) -> type[BaseModel] | None:
    """The pydantic model a component declares for its ``options``: a ``Config`` attribute, or for an
    advantage estimator the ``options`` of its traits."""
    traits = getattr(factory, "traits", None)
    model = traits.options if isinstance(traits, EstimatorTraits) else getattr(factory, "Config", None)
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
    base = CONTRACTS.get(kind)
    if base is not None and not (isinstance(factory, type) and issubclass(factory, base)):
        return [Violation(entry.dist, field, f"{kind} '{name}' ({entry.factory}) is not a {base.__name__} subclass",
                          f"a plugin bug: {entry.dist} must register a unirl.contracts.{base.__name__}")]
    if kind == "advantage_estimators":
        try:
            traits_of(factory)
        except PluginError as exc:
            return [Violation(entry.dist, field, str(exc), f"a plugin bug: report it to {entry.dist}")]
    if kind == "policy_losses":
        try:
            metric_reduce_of(factory)
        except PluginError as exc:
            return [Violation(entry.dist, field, str(exc), f"a plugin bug: report it to {entry.dist}")]
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


def _loaded(kernel: Kernel, kind: str, name: str | None) -> Any:
    """The factory for ``name`` when it resolves (its own violation is reported elsewhere), else None."""
    if not name:
        return None
    try:
        return kernel.get(kind, name).load()
    except PluginError:
        return None


def _pairing_violations(config: RunConfig, kernel: Kernel) -> list[Violation]:
    """Checks that need two components at once, read from what each declares (never from names)."""
    out: list[Violation] = []
    a, r = config.algorithm, config.rollout
    est = _loaded(kernel, "advantage_estimators", a.estimator)
    traits = getattr(est, "traits", None)
    if isinstance(traits, EstimatorTraits):
        if r.n < traits.min_n:
            out.append(Violation(CORE, "rollout.n", f"{a.estimator} needs at least {traits.min_n} samples per "
                                 f"prompt, got {r.n}", f"set rollout.n >= {traits.min_n} (8 is typical)"))
        if traits.needs_values and not config.actor.value_head:
            out.append(Violation(CORE, "actor.value_head", f"estimator '{a.estimator}' needs a value head",
                                 "set actor.value_head: true"))
    engine = _loaded(kernel, "rollout_engines", r.engine)
    if isinstance(engine, type) and issubclass(engine, RolloutEngine):
        try:
            caps = engine.capabilities(config)
        except Exception as exc:  # noqa: BLE001 - a broken declaration is the plugin's bug
            return out + [Violation(CORE, "rollout.engine", f"capabilities() of '{r.engine}' raised {exc!r}",
                                    "report it to the engine's plugin")]
        if not isinstance(caps, EngineCapabilities):
            return out + [Violation(CORE, "rollout.engine", f"capabilities() of '{r.engine}' returned "
                                    f"{type(caps).__name__}, not EngineCapabilities", "report it to the engine's plugin")]
        if config.weight_sync.name not in caps.weight_syncs:
            out.append(Violation(CORE, "weight_sync.name", f"rollout.engine '{r.engine}' cannot load weights "
                                 f"through '{config.weight_sync.name}'",
                                 f"set weight_sync.name to one of: {', '.join(caps.weight_syncs)}"))
        if a.old_logp_source == "rollout" and caps.logprobs != "raw":
            out.append(Violation(CORE, "algorithm.old_logp_source", f"'{r.engine}' returns {caps.logprobs} "
                                 "log-probs (after temperature / top-p / top-k), which cannot stand in for pi_old",
                                 "set algorithm.old_logp_source: replay, or make the engine return raw log-probs"))
        if r.environment and not caps.continuation:
            out.append(Violation(CORE, "rollout.environment", f"multi-turn environment '{r.environment}' needs "
                                 f"continuation, which engine '{r.engine}' does not support",
                                 "pick an engine whose capabilities include continuation"))
    if r.max_response_tokens is not None and r.max_response_tokens < r.max_new_tokens and not r.environment:
        out.append(Violation(CORE, "rollout.max_response_tokens", f"{r.max_response_tokens} is below "
                             f"rollout.max_new_tokens {r.max_new_tokens} for single-turn rollouts",
                             "raise it, or unset it (it caps multi-turn trajectories)"))
    return out


def _engine_caps(config: RunConfig, kernel: Kernel) -> EngineCapabilities | None:
    """The selected engine's declared capabilities, or None (a broken one is reported by the pairing checks)."""
    engine = _loaded(kernel, "rollout_engines", config.rollout.engine)
    if not (isinstance(engine, type) and issubclass(engine, RolloutEngine)):
        return None
    try:
        caps = engine.capabilities(config)
    except Exception:  # noqa: BLE001 - reported by _pairing_violations
        return None
    return caps if isinstance(caps, EngineCapabilities) else None


#: the rollout keys that only apply with ``rollout.mode: async``
ASYNC_KEYS = ("max_staleness", "weight_sync_interval", "max_inflight")


def async_violations(config: RunConfig, caps: EngineCapabilities | None) -> list[Violation]:
    """``rollout.mode`` and its keys (docs/async.md), against what the engine declares.

    An async key set in sync mode would be silently ignored, so it is a violation; async needs an engine
    whose ``submit`` returns before the generation ends (else nothing overlaps), and it draws each batch
    in one launch, so DAPO's dynamic sampling (which draws more rounds on demand) stays sync-only."""
    r, out = config.rollout, []
    if r.mode == "sync":
        for key in ASYNC_KEYS:
            if key in r.model_fields_set:
                out.append(Violation(CORE, f"rollout.{key}", "only applies with rollout.mode: async",
                                     f"set rollout.mode: async, or remove rollout.{key}"))
        return out
    if caps is not None and not caps.async_submit:
        out.append(Violation(CORE, "rollout.mode", f"rollout.engine '{r.engine}' runs each generation inside "
                             "submit (async_submit: false), so async rollout cannot overlap it with training",
                             "set rollout.mode: sync, or pick an engine with async submit"))
    if config.algorithm.dynamic_sampling.enabled:
        out.append(Violation(CORE, "algorithm.dynamic_sampling.enabled", "dynamic sampling draws extra rounds "
                             "inside a step, which async rollout does not do", "set rollout.mode: sync, or disable it"))
    if r.max_staleness > 0 and r.max_inflight < 2 and not r.controller:  # a controller prefetches one collect
        out.append(Violation(CORE, "rollout.max_inflight", f"max_staleness {r.max_staleness} with max_inflight 1: "
                             "the next batch can never launch while one is generating, so nothing overlaps",
                             "set rollout.max_inflight >= 2 (or max_staleness: 0 for on-policy async)"))
    return out


def algorithm_violations(config: RunConfig) -> list[Violation]:
    """Algorithm settings that only make sense together (docs/algorithms.md).

    Dr. GRPO is two settings (the estimator without the std division and the ``seq-mean-token-sum-norm``
    aggregation); ``estimator: dr_grpo`` sets both, and setting only one of them is a violation rather
    than a warning: half of Dr. GRPO is neither the paper nor GRPO, and a run a user believes is Dr. GRPO
    should not silently be something else."""
    a, r = config.algorithm, config.rollout
    out: list[Violation] = []
    norm = "seq-mean-token-sum-norm"
    if a.estimator == "dr_grpo" and a.loss_agg != norm:
        out.append(Violation(CORE, "algorithm.loss_agg", f"estimator dr_grpo with loss_agg {a.loss_agg}: only half "
                             f"of Dr. GRPO (it also drops the length bias with {norm})",
                             f"unset algorithm.loss_agg (dr_grpo sets {norm}), or use estimator grpo"))
    if a.loss_agg == norm and a.estimator == "grpo":
        out.append(Violation(CORE, "algorithm.estimator", f"loss_agg {norm} with estimator grpo (which divides by "
                             "the group std): only half of Dr. GRPO",
                             "set algorithm.estimator: dr_grpo, or another loss_agg"))
    if a.kl_form == "reward" and a.kl_coef <= 0:
        out.append(Violation(CORE, "algorithm.kl_form", "kl_form: reward with kl_coef 0 adds no penalty",
                             "set algorithm.kl_coef > 0, or kl_form: loss"))
    if a.dynamic_sampling.enabled and r.n < 2:
        out.append(Violation(CORE, "algorithm.dynamic_sampling.enabled", f"rollout.n = {r.n}: every group has "
                             "one sample, so all would be dropped", "set rollout.n >= 2"))
    if a.overlong.enabled and a.overlong.buffer_tokens >= r.max_new_tokens:
        out.append(Violation(CORE, "algorithm.overlong.buffer_tokens", f"{a.overlong.buffer_tokens} is not below "
                             f"rollout.max_new_tokens {r.max_new_tokens}",
                             "the soft penalty zone must be the tail of the budget (DAPO: 4096 of 20480)"))
    return out


def core_violations(config: RunConfig, kernel: Kernel) -> list[Violation]:
    out: list[Violation] = []
    for kind, field, opt_field in SELECTIONS:
        out += _check_selection(kernel, config, kind, field, opt_field)
    for kind, field, opt_field in OPTIONAL_SELECTIONS:
        if _get(config, field):
            out += _check_selection(kernel, config, kind, field, opt_field)
        elif opt_field and _get(config, opt_field):
            out.append(Violation(CORE, opt_field, f"options given but {field} is not set", f"set {field} or remove them"))
    for i, name in enumerate(config.algorithm.modifiers):
        try:
            kernel.get("loss_modifiers", name)
        except PluginError as exc:
            out.append(Violation(CORE, f"algorithm.modifiers[{i}]", str(exc), "install the plugin or remove it"))
    for i, name in enumerate(config.rollout.tools):
        try:
            kernel.get("tools", name)
        except PluginError as exc:
            out.append(Violation(CORE, f"rollout.tools[{i}]", str(exc), "install the tool's plugin or remove it"))
    if config.rollout.tools and not config.rollout.environment:
        out.append(Violation(CORE, "rollout.tools", "tools are offered by an environment, but rollout.environment "
                             "is not set", "set rollout.environment (e.g. a tool environment) or remove the tools"))
    r = config.rollout
    if r.environment and not r.controller:
        out.append(Violation(CORE, "rollout.environment", f"environment '{r.environment}' needs a rollout "
                             "controller to run its turns, but rollout.controller is not set",
                             "set rollout.controller (e.g. agentic, from unirl-agentic)"))
    if r.controller and config.algorithm.dynamic_sampling.enabled:
        out.append(Violation(CORE, "algorithm.dynamic_sampling.enabled", f"controller '{r.controller}' collects "
                             "whole groups itself; DAPO's refill is not wired through a controller",
                             "set algorithm.dynamic_sampling.enabled: false"))
    out += _pairing_violations(config, kernel)
    out += async_violations(config, _engine_caps(config, kernel))
    a = config.algorithm
    out += algorithm_violations(config)
    if a.clip_high < a.clip_low:
        out.append(Violation(CORE, "algorithm.clip_high", f"{a.clip_high} < clip_low {a.clip_low}",
                             "clip-higher means clip_high >= clip_low"))
    out += reward_violations(config, kernel)  # a judge / reward model loads and fits, its template has its fields
    out += data_violations(config)  # reads every dataset file: encoding, JSON, fields, enough rows
    out += model_dir_violations(config)
    return out


def model_dir_violations(config: RunConfig) -> list[Violation]:
    """``model.path`` must be an HF model directory: it exists and holds a readable ``config.json`` with a
    ``model_type`` (the adapter checks that it can build that type, in its own preflight)."""
    path = config.model.path
    if not path:
        return []
    fix = "point model.path at a local HF model directory (one with config.json), or unset it to build a tiny model"
    p = Path(path)
    if not p.is_dir():
        return [Violation(CORE, "model.path", f"model directory {path} does not exist", fix)]
    cfg = p / "config.json"
    if not cfg.is_file():
        return [Violation(CORE, "model.path", f"{path} has no config.json: not a model directory", fix)]
    try:
        import json

        model_type = json.loads(cfg.read_text()).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return [Violation(CORE, "model.path", f"{cfg} is not readable JSON ({type(exc).__name__}: {exc})", fix)]
    if not model_type:
        return [Violation(CORE, "model.path", f"{cfg} names no model_type", fix)]
    weights = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")
    if not any(next(p.glob(pattern), None) for pattern in weights):
        return [Violation(CORE, "model.path", f"{path} has config.json but no weights (*.safetensors or "
                          "pytorch_model.bin)", "copy the model's weight files next to its config.json")]
    return []


def model_type_violations(config: RunConfig, adapter: Any) -> list[Violation]:
    """``model.path``'s ``model_type`` must be one the selected adapter builds (``ModelAdapter.model_types``),
    so a wrong family fails here, not inside a load or a kernel patch. Unreadable directories are
    :func:`model_dir_violations`' to report."""
    if not config.model.path or not adapter.model_types:
        return []
    try:
        import json

        model_type = json.loads((Path(config.model.path) / "config.json").read_text()).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError):
        return []
    if not model_type or model_type in adapter.model_types:
        return []
    return [Violation(CORE, "model.adapter",
                      f"model.path holds a {model_type!r} model; adapter {config.model.adapter!r} builds "
                      f"{', '.join(adapter.model_types)}",
                      "set model.adapter to an adapter for that family (`unirl plugins` lists them)")]


def plugin_violations(config: RunConfig, kernel: Kernel) -> list[Violation]:
    out: list[Violation] = []
    adapter = None
    factory = _loaded(kernel, "model_adapters", config.model.adapter)
    if factory is not None:
        try:
            adapter = factory()
        except Exception:  # noqa: BLE001 - reported by the adapter's own selection check
            adapter = None
    if adapter is not None:
        out += model_type_violations(config, adapter)
    for dist, answer in _safe_calls(kernel, "unirl_preflight", config, adapter):
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


def _safe_calls(kernel: Kernel, hook: str, config: RunConfig, adapter: Any) -> list[tuple[str, Any]]:
    """Like :meth:`Kernel.call`, but a check that raises becomes a violation instead of a crash."""
    out: list[tuple[str, Any]] = []
    caller = getattr(kernel.hook, hook)
    offered = {"config": config, "adapter": adapter}
    for impl in reversed(caller.get_hookimpls()):
        dist = kernel.dist_of(impl.plugin_name)
        try:
            out.append((dist, impl.function(**{k: v for k, v in offered.items() if k in impl.argnames})))
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
