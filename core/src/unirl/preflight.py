"""Preflight: find every problem in a run config before anything expensive starts.

Core checks the things it owns (are the selected components registered, do their ``options``
validate against the plugin's ``Config`` model, do the pieces fit together) and then asks every
plugin's ``unirl_preflight`` hook. All violations come back in one report, so a recipe is fixed in one
pass rather than one crash at a time, and nothing is lost: no Ray cluster, no model, no run directory
has been touched yet.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from unirl.algorithms.losses import check_loss_signature, metric_reduce_of
from unirl.config import RunConfig
from unirl.contracts import (
    Actor,
    Capabilities,
    EngineCapabilities,
    EstimatorTraits,
    RolloutController,
    RolloutEngine,
    TraceExporter,
    Tracker,
    WeightSync,
    traits_of,
)
from unirl.data.datasets import data_violations
from unirl.data.image_rules import image_violations
from unirl.declared import resolve
from unirl.inert import (  # noqa: F401 - the rule table, re-exported
    ASYNC_KEYS,
    INERT,
    Inert,
    inert_violations,
    is_set,
    reinforce_pp_gamma_violations,
    sft_only_violations,
)
from unirl.kernel.errors import OptionsError, PluginError, PreflightError, Violation
from unirl.kernel.manager import Kernel, Raised
from unirl.plugin_sections import section_violations
from unirl.rewards.build import gold_parsers, reward_violations
from unirl.writable import writable_violations

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
    ("rollout_controllers", "rollout.controller", None),
)

#: optional selections: checked only when set
OPTIONAL_SELECTIONS: tuple[tuple[str, str, str | None], ...] = (
    ("environments", "rollout.environment", None),
    ("trace_exporters", "trace.exporter", "trace.options"),
)


#: the contract class a registry's factories must subclass (function registries have none)
CONTRACTS: dict[str, type] = {
    "rollout_engines": RolloutEngine,
    "actors": Actor,
    "weight_syncs": WeightSync,
    "trace_exporters": TraceExporter,
    "trackers": Tracker,
    "rollout_controllers": RolloutController,
}


class Unregistered(Violation):
    """Core's "no component named X" violation for a selection field.

    A plugin that knows why the name is missing (it comes with an extra that is not installed) reports
    the same field with the exact install command as its fix; :func:`preflight` then drops this generic one, so
    the user reads one line that says what to install rather than two that disagree."""


def _get(config: RunConfig, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _check_selection(kernel: Kernel, config: RunConfig, kind: str, field: str, opt_field: str | None) -> list[Violation]:
    return _check_named(kernel, kind, _get(config, field), field, opt_field,
                        _get(config, opt_field) if opt_field is not None else None)


def _check_named(kernel: Kernel, kind: str, name: str, field: str, opt_field: str | None, options: Any,
                 pick: str = "pick one of", hint: str = "") -> list[Violation]:
    """``name`` (given at ``field``) is registered under ``kind``, loads, is the kind's contract class
    (estimator traits, loss metric reductions) and takes ``options`` (given at ``opt_field``)."""
    try:
        entry = kernel.get(kind, name)
    except PluginError as exc:
        return [Unregistered(CORE, field, str(exc), f"{pick}: {', '.join(kernel.names(kind)) or 'none'}{hint}")]
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
            check_loss_signature(factory)
            metric_reduce_of(factory)
        except PluginError as exc:
            return [Violation(entry.dist, field, str(exc), f"a plugin bug: report it to {entry.dist}")]
    if opt_field is None:
        return []
    try:  # the kernel's one validation, the one Kernel.build runs: each bad field reported once, here
        kernel.options(kind, name, options, opt_field, factory=factory)
    except OptionsError as exc:
        return exc.violations
    return []


def _loaded(kernel: Kernel, kind: str, name: str | None) -> Any:
    """The factory for ``name`` when it resolves (its own violation is reported elsewhere), else None."""
    if not name:
        return None
    try:
        return kernel.get(kind, name).load()
    except PluginError:
        return None


def _pairing_violations(config: RunConfig, kernel: Kernel, declared: Capabilities,
                        broken: list[Violation]) -> list[Violation]:
    """Checks that need two components at once, read from what each declares (never from names);
    ``broken`` are the declarations that failed (:func:`unirl.declared.resolve`), reported here once."""
    out: list[Violation] = []
    a, r = config.algorithm, config.rollout
    est = _loaded(kernel, "advantage_estimators", a.estimator)
    traits = getattr(est, "traits", None)
    if isinstance(traits, EstimatorTraits):
        if r.n < traits.min_n:
            out.append(Violation(CORE, "rollout.n", f"{a.estimator} needs at least {traits.min_n} samples per "
                                 f"prompt, got {r.n}", f"set rollout.n >= {traits.min_n} (8 is typical)"))
        if a.group_layer == "fork" and r.branching is not None and r.branching.n < traits.min_n:
            out.append(Violation(CORE, "rollout.branching.n", f"{a.estimator} needs at least {traits.min_n} samples "
                                 f"per group, and under algorithm.group_layer: fork a fork point's group is its "
                                 f"{r.branching.n} branches", f"set rollout.branching.n >= {traits.min_n}"))
        if traits.needs_values and not config.actor.value_head:
            out.append(Violation(CORE, "actor.value_head", f"estimator '{a.estimator}' needs a value head",
                                 "set actor.value_head: true"))
        if a.group_layer not in traits.group_layers:
            out.append(Violation(CORE, "algorithm.group_layer", f"estimator '{a.estimator}' cannot group by "
                                 f"'{a.group_layer}' (it implements: {', '.join(traits.group_layers)})",
                                 f"set algorithm.group_layer to one of: {', '.join(traits.group_layers)}, or pick an "
                                 "estimator that groups by that layer (grpo, dr_grpo, rloo, reinforce_pp_baseline: "
                                 "root, turn, fork; gae: root, turn)"))
    out += broken
    caps = declared.engine
    if caps is not None:
        if config.weight_sync.name not in caps.weight_syncs:
            out.append(Violation(CORE, "weight_sync.name", f"rollout.engine '{r.engine}' cannot load weights "
                                 f"through '{config.weight_sync.name}'",
                                 f"set weight_sync.name to one of: {', '.join(caps.weight_syncs)}"))
        if config.algorithm.routing_replay and not caps.routing_record:  # R3 needs the engine's records
            out.append(Violation(CORE, "algorithm.routing_replay", f"rollout.engine '{r.engine}' does not record "
                                 "the experts it routes each token by", "use an engine that does (torch, vllm), "
                                 "or set algorithm.routing_replay: false"))
        if caps.logprobs != r.logprobs:  # the actor replays rollout.logprobs (unirl.logprobs)
            out.append(Violation(CORE, "rollout.logprobs", f"rollout.engine '{r.engine}' returns {caps.logprobs} "
                                 f"log-probs but rollout.logprobs is '{r.logprobs}', which the actor replays: "
                                 "rollout_logprobs (and pi_old with old_logp_source: rollout) would be another "
                                 "distribution than the actor's", f"set rollout.logprobs: {caps.logprobs}, or make "
                                 f"the engine return {r.logprobs} log-probs (vLLM: rollout.options.logprobs_mode: "
                                 f"{r.logprobs}_logprobs)"))
        lora = config.actor.lora
        if lora is not None and lora.sync == "adapter" and not caps.lora_adapters:
            out.append(Violation(CORE, "actor.lora.sync", f"rollout.engine '{r.engine}' cannot serve a LoRA adapter "
                                 "under this configuration (its capabilities declare no lora_adapters), so the "
                                 "adapter alone cannot be published", "set actor.lora.sync: merged (any engine), or "
                                 "use an engine that serves adapters (rollout.engine: vllm, tensor_parallel_size 1)"))
        if r.environment and not caps.continuation:
            out.append(Violation(CORE, "rollout.environment", f"multi-turn environment '{r.environment}' needs "
                                 f"continuation, which engine '{r.engine}' does not support",
                                 "pick an engine whose capabilities include continuation"))
    if r.branching is not None:
        if a.group_layer != "fork":
            out.append(Violation(CORE, "algorithm.group_layer", f"rollout.branching forks trajectories, but "
                                 f"algorithm.group_layer is '{a.group_layer}': the branches of one fork point would "
                                 "not be compared with each other", "set algorithm.group_layer: fork"))
        ctl = _loaded(kernel, "rollout_controllers", r.controller)
        if isinstance(ctl, type) and issubclass(ctl, RolloutController) and not ctl.supports_branching:
            out.append(Violation(CORE, "rollout.branching", f"rollout.controller '{r.controller}' does not fork "
                                 "trajectories (its supports_branching is false)",
                                 "remove rollout.branching, or use a controller that branches (agentic)"))
    if r.mode == "stream":
        ctl = _loaded(kernel, "rollout_controllers", r.controller)
        if isinstance(ctl, type) and issubclass(ctl, RolloutController) and not ctl.concurrent_collects:
            out.append(Violation(CORE, "rollout.mode", f"rollout.controller '{r.controller}' does not declare "
                                 "concurrent_collects, and stream mode runs one-group collects concurrently",
                                 "set rollout.mode: async, or use a controller that declares it (batch)"))
    if r.max_response_tokens is not None and r.max_response_tokens < r.max_new_tokens and not r.environment:
        out.append(Violation(CORE, "rollout.max_response_tokens", f"{r.max_response_tokens} is below "
                             f"rollout.max_new_tokens {r.max_new_tokens} for single-turn rollouts",
                             "raise it, or unset it (it caps multi-turn trajectories)"))
    return out


def async_violations(config: RunConfig, caps: EngineCapabilities | None) -> list[Violation]:
    """``rollout.mode: async`` against what the engine declares (docs/async.md).

    Async needs an engine whose ``submit`` returns before the generation ends (else nothing overlaps),
    and it draws each batch in one launch, so DAPO's dynamic sampling (which draws more rounds on
    demand) stays sync-only. The async keys set in sync mode are :data:`INERT` rules."""
    r, out = config.rollout, []
    if r.mode == "sync":
        return out
    if caps is not None and not caps.async_submit:
        out.append(Violation(CORE, "rollout.mode", f"rollout.engine '{r.engine}' runs each generation inside "
                             "submit (async_submit: false), so async rollout cannot overlap it with training",
                             "set rollout.mode: sync, or pick an engine with async submit"))
    if r.mode == "stream" and caps is not None and caps.requests_across_sync != "queued":
        out.append(Violation(CORE, "rollout.mode", f"rollout.engine '{r.engine}' cannot keep requests across a "
                             "weight load (requests_across_sync: none), which stream mode's sync needs",
                             "set rollout.mode: async, or use an engine that keeps them (torch)"))
    if config.algorithm.dynamic_sampling.enabled:
        out.append(Violation(CORE, "algorithm.dynamic_sampling.enabled", "dynamic sampling draws extra rounds "
                             "inside a step, which async rollout does not do", "set rollout.mode: sync, or disable it"))
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
    if a.dynamic_sampling.enabled and r.n < 2:
        out.append(Violation(CORE, "algorithm.dynamic_sampling.enabled", f"rollout.n = {r.n}: every group has "
                             "one sample, so all would be dropped", "set rollout.n >= 2"))
    if a.overlong.enabled and a.overlong.buffer_tokens >= r.max_new_tokens:
        out.append(Violation(CORE, "algorithm.overlong.buffer_tokens", f"{a.overlong.buffer_tokens} is not below "
                             f"rollout.max_new_tokens {r.max_new_tokens}",
                             "the soft penalty zone must be the tail of the budget (DAPO: 4096 of 20480)"))
    return out


def tracker_violations(config: RunConfig, kernel: Kernel) -> list[Violation]:
    """Every ``logging.trackers`` name registered, a :class:`~unirl.contracts.Tracker`, with valid
    ``logging.options``; options for a tracker that is not listed are inert. An unknown name lists the
    installed trackers (W&B, MLflow and Trackio come with ``pip install unirl-trackers``)."""
    out: list[Violation] = []
    lg = config.logging
    for i, name in enumerate(lg.trackers):
        out += _check_named(kernel, "trackers", name, f"logging.trackers[{i}]", f"logging.options.{name}",
                            lg.options.get(name, {}),
                            pick="installed trackers", hint=" (wandb and mlflow: pip install unirl-trackers)")
    for name in lg.options:
        if name not in lg.trackers:
            out.append(Violation(CORE, f"logging.options.{name}", f"options given for '{name}', which is not in "
                                 "logging.trackers", f"add {name} to logging.trackers, or remove its options"))
    return out


def chat_violations(config: RunConfig, kernel: Kernel) -> list[Violation]:
    """``data.chat_template``: the policy's tokenizer has a template, prompts are not truncated (that
    would cut the template's head), and a multi-turn environment gets an end-of-turn token to append
    its turns after. The tokenizer is built here (cheap, no model) because only it knows its template."""
    d = config.data
    if not d.chat_template:
        return []
    out: list[Violation] = []
    if d.overlong == "truncate":
        out.append(Violation(CORE, "data.overlong", "truncate keeps a prompt's last tokens, which would cut the "
                             "chat template's head (the system turn, the user turn's start)",
                             "set data.overlong: reject and raise data.max_prompt_tokens if needed"))
    try:
        tok = kernel.build("model_adapters", config.model.adapter).build_tokenizer(config)
    except Exception:  # noqa: BLE001 - the adapter and model checks report why it does not load
        return out
    if not getattr(tok, "chat_template", None):
        return out + [Violation(CORE, "data.chat_template", "the policy's tokenizer has no chat template",
                                "set data.chat_template: false, or model.tokenizer to a tokenizer with one")]
    from unirl.data.chat import end_of_turn_id

    try:
        eot = end_of_turn_id(tok)
    except Exception as exc:  # noqa: BLE001 - a template that does not render is the finding
        return out + [Violation(CORE, "data.chat_template", f"the tokenizer's chat template does not render a "
                                f"user / assistant conversation: {type(exc).__name__}: {exc}",
                                "fix the template, or set data.chat_template: false")]
    if eot is None and config.rollout.environment:
        out.append(Violation(CORE, "data.chat_template", "the chat template closes an assistant turn with no "
                             "special token, so an environment's turns cannot be appended after generated ones",
                             "use a template that ends turns with a special token (e.g. <|im_end|>)"))
    return out


def core_violations(config: RunConfig, kernel: Kernel,
                    resolved: tuple[Capabilities, list[Violation]] | None = None) -> list[Violation]:
    out: list[Violation] = []
    for kind, field, opt_field in SELECTIONS:
        out += _check_selection(kernel, config, kind, field, opt_field)
    out += tracker_violations(config, kernel)
    for kind, field, opt_field in OPTIONAL_SELECTIONS:
        if _get(config, field):  # options without their selection: an INERT rule
            out += _check_selection(kernel, config, kind, field, opt_field)
    out += reinforce_pp_gamma_violations(config)
    out += chat_violations(config, kernel)
    for i, name in enumerate(config.algorithm.modifiers):
        try:
            kernel.get("loss_modifiers", name)
        except PluginError as exc:
            if name == "rollout_correction" and config.algorithm.rollout_is_threshold is not None:  # the alias's
                out.append(Violation(CORE, "algorithm.rollout_is_threshold", f"the alias enables {exc}",
                                     "pip install unirl-rollout-correction, or remove algorithm.rollout_is_threshold"))
                continue
            out.append(Violation(CORE, f"algorithm.modifiers[{i}]", str(exc), "install the plugin or remove it"))
    for i, name in enumerate(config.rollout.tools):
        try:
            kernel.get("tools", name)
        except PluginError as exc:
            out.append(Violation(CORE, f"rollout.tools[{i}]", str(exc), "install the tool's plugin or remove it"))
    r, (declared, broken) = config.rollout, resolved or resolve(config, kernel)
    ctl = declared.controller
    if r.environment and ctl is not None and not ctl.drives_environments:
        out.append(Violation(CORE, "rollout.environment", f"environment '{r.environment}' needs a rollout "
                             f"controller that runs its turns, but rollout.controller '{r.controller}' does not "
                             "(its capabilities declare no drives_environments)",
                             "set rollout.controller (e.g. agentic, from unirl-agentic)"))
    out += inert_violations(config)
    out += section_violations(config, kernel)
    out += _pairing_violations(config, kernel, declared, broken)
    out += async_violations(config, declared.engine)
    a = config.algorithm
    out += algorithm_violations(config)
    if a.clip_high < a.clip_low:
        out.append(Violation(CORE, "algorithm.clip_high", f"{a.clip_high} < clip_low {a.clip_low}",
                             "clip-higher means clip_high >= clip_low"))
    out += reward_violations(config, kernel)  # a judge / reward model loads and fits, its template has its fields
    # reads every dataset file: encoding, JSON, fields, enough rows, gold answers the reward can parse
    out += data_violations(config, gold_parsers(config, kernel))
    out += model_dir_violations(config)
    out += writable_violations(config)  # run.output_dir and the caches: a probe write (unirl.writable)
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


#: the attribute names transformers configs give the expert count, by family (Qwen-MoE, Mixtral, DeepSeek)
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def model_violations(config: RunConfig, adapter: Any) -> list[Violation]:
    """The model this run builds, checked through its adapter before it is built: ``model.build``'s keys
    (:meth:`ModelAdapter.build_keys`), then the architecture of :meth:`ModelAdapter.hf_config`
    (:func:`architecture_violations`) and its position limit (:func:`position_violations`).

    Why here: transformers stores a misspelt key as an unused attribute (the default architecture is
    built silently), and an inconsistent one (top-k above the expert count) fails only inside the
    first forward, after the model, the engine and the warm start were built."""
    m, out = config.model, []
    if m.build and not m.path:  # with model.path, model.build is an INERT rule
        try:
            keys = adapter.build_keys(config)
        except Exception as exc:  # noqa: BLE001 - a broken declaration is the adapter's bug
            keys = None
            out.append(Violation(CORE, "model.adapter", f"build_keys() of adapter '{m.adapter}' raised "
                                 f"{type(exc).__name__}: {exc}", "report it to the adapter's plugin"))
        for key in sorted(m.build) if keys is not None else ():
            if key not in keys:
                close = difflib.get_close_matches(key, keys, n=1)
                fix = (f"did you mean '{close[0]}'?" if close else
                       f"remove it; adapter '{m.adapter}' takes: {', '.join(sorted(keys))}")
                out.append(Violation(CORE, f"model.build.{key}", f"unknown key for adapter '{m.adapter}' (its "
                                     "transformers config would store it unread and build the default)", fix))
    if m.tokenizer and not m.path and not Path(m.tokenizer).is_dir():  # the build is sized to it: say which
        return out + [Violation(CORE, "model.tokenizer", f"{m.tokenizer} is not a directory (the model's "
                                "vocabulary is sized to its tokenizer)", "point it at a tokenizer directory "
                                "(save_pretrained), or unset it for the demo tokenizer")]
    try:
        hf = adapter.hf_config(config)
    except Exception as exc:  # noqa: BLE001 - a build that does not construct is the violation
        if m.path:  # model_dir_violations names what is wrong with the directory
            return out
        return out + [Violation(CORE, "model.build", f"adapter '{m.adapter}' cannot build its config from it: "
                                f"{type(exc).__name__}: {exc}", "fix the model.build values")]
    return out + architecture_violations(config, hf) + position_violations(config, hf)


def _arch_field(config: RunConfig, *keys: str) -> str:
    """Where an architecture value came from: the first of ``keys`` set in ``model.build``, else the
    model directory, else the adapter's default build."""
    given = [k for k in keys if k in config.model.build]
    return f"model.build.{given[0]}" if given else ("model.path" if config.model.path else f"model.build.{keys[0]}")


def architecture_violations(config: RunConfig, hf: Any) -> list[Violation]:
    """Architecture facts that must agree, read from the transformers config (any family that names them):
    top-k routing within the expert count, and query heads a multiple of key-value heads (GQA repeats
    each KV head ``heads / kv_heads`` times). Both fail only in the first forward otherwise."""
    out: list[Violation] = []
    top_k = getattr(hf, "num_experts_per_tok", None)
    count = next((k for k in EXPERT_COUNTS if isinstance(getattr(hf, k, None), int)), None)
    total = getattr(hf, count) if count else None
    if isinstance(top_k, int) and total is not None and top_k > total:
        out.append(Violation(CORE, _arch_field(config, "num_experts_per_tok", *EXPERT_COUNTS),
                             f"num_experts_per_tok {top_k} is above the model's {total} experts: each token "
                             "would route to more experts than exist",
                             f"set model.build.num_experts_per_tok <= {total}, or raise model.build.{count}"))
    if config.algorithm.router_aux_loss_coef > 0 and total is None:  # else the actor refuses it in the first step
        out.append(Violation(CORE, "algorithm.router_aux_loss_coef", "the model has no experts (its config names "
                             f"none of {', '.join(EXPERT_COUNTS)}), so there is no router loss to weight",
                             "set algorithm.router_aux_loss_coef: 0, or use a Mixture-of-Experts model "
                             "(e.g. model.adapter: qwen3_moe)"))
    if config.algorithm.routing_replay and total is None:  # R3 (unirl.routing): no router to replay
        out.append(Violation(CORE, "algorithm.routing_replay", "the model has no experts, so there is no routing "
                             "to replay", "set algorithm.routing_replay: false, or use model.adapter: qwen3_moe"))
    heads, kv = getattr(hf, "num_attention_heads", None), getattr(hf, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
        out.append(Violation(CORE, _arch_field(config, "num_key_value_heads", "num_attention_heads"),
                             f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}",
                             "pick num_key_value_heads that divides num_attention_heads"))
    return out


def position_violations(config: RunConfig, hf: Any) -> list[Violation]:
    """The longest sequence a run feeds the model must fit its position limit (``max_position_embeddings``):
    ``data.max_prompt_tokens`` plus the response budget, which is ``rollout.max_new_tokens`` for one turn
    and ``rollout.max_response_tokens`` for a multi-turn trajectory. Why: rotary models do not refuse
    positions past the limit, they train on them silently, on positions the model never learned."""
    limit = getattr(hf, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return []
    d, r = config.data, config.rollout
    budget, budget_field = r.max_new_tokens, "rollout.max_new_tokens"
    if r.environment and r.max_response_tokens is not None:
        budget, budget_field = r.max_response_tokens, "rollout.max_response_tokens"
    need = d.max_prompt_tokens + budget
    if need <= limit:
        return []
    where = ("model.path's config.json" if config.model.path else "model.build" if "max_position_embeddings"
             in config.model.build else f"the default build of adapter '{config.model.adapter}'")
    lower = [f"{f} to {v}" for f, v in (("data.max_prompt_tokens", limit - budget),
                                        (budget_field, limit - d.max_prompt_tokens)) if v >= 1]
    grow = ("use a model with a longer context" if config.model.path
            else f"set model.build.max_position_embeddings >= {need}")
    return [Violation(CORE, "data.max_prompt_tokens", f"data.max_prompt_tokens {d.max_prompt_tokens} + {budget_field} "
                      f"{budget} = {need} tokens, beyond the model's {limit} positions (max_position_embeddings, "
                      f"from {where})", (f"lower {' or '.join(lower)}, or " if lower else "") + grow)]


def plugin_violations(config: RunConfig, kernel: Kernel, declared: Capabilities | None = None) -> list[Violation]:
    out: list[Violation] = []
    declared = declared if declared is not None else resolve(config, kernel)[0]
    adapter = None
    factory = _loaded(kernel, "model_adapters", config.model.adapter)
    if factory is not None:
        try:
            adapter = factory()
        except Exception:  # noqa: BLE001 - reported by the adapter's own selection check
            adapter = None
    if adapter is not None:
        wrong_type = model_type_violations(config, adapter)
        out += (wrong_type or model_violations(config, adapter)) + image_violations(config, adapter)
    for dist, answer in _safe_calls(kernel, "unirl_preflight", config, adapter, capabilities=declared):
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


def _safe_calls(kernel: Kernel, hook: str, config: RunConfig, adapter: Any, **more: Any) -> list[tuple[str, Any]]:
    """:meth:`Kernel.call_each` (the kernel's one hook walk), but a check that raises becomes a
    violation instead of a crash. The hook gets the kernel it runs in as ``kernel``."""
    out: list[tuple[str, Any]] = []
    for dist, answer in kernel.call_each(hook, isolate=True, config=config, adapter=adapter, kernel=kernel, **more):
        if isinstance(answer, Raised):
            exc = answer.exc
            answer = [Violation(dist, hook, f"raised {type(exc).__name__}: {exc}", "report to the plugin")]
        out.append((dist, answer))
    return out


def preflight(config: RunConfig, kernel: Kernel) -> list[Violation]:
    """Every violation from core and from every plugin, in one list.

    A plugin violation whose fix is a ``pip install`` command and whose ``field`` (comma-separated for
    several) names a selection core found unregistered replaces core's generic "no ... named" for it
    (see :class:`Unregistered`). Only an install line does: any other plugin complaint about the same
    field (a typo'd engine name, say) leaves core's message, with its list of what exists, in place."""
    resolved = resolve(config, kernel)  # the declarations, once, for core's checks and every plugin's
    plugin = plugin_violations(config, kernel, resolved[0])
    claimed = {f.strip() for v in plugin if v.fix.startswith("pip install") for f in v.field.split(",")}
    core = [v for v in core_violations(config, kernel, resolved) if not (isinstance(v, Unregistered) and v.field in claimed)]
    return core + plugin


def check(config: RunConfig, kernel: Kernel, *, rl: bool = True) -> None:
    """Raise :class:`PreflightError` with every violation. ``rl=False`` is ``unirl sft`` (the warm start
    alone), which has one rule of its own: it must train something."""
    violations = preflight(config, kernel) + ([] if rl else sft_only_violations(config))
    if violations:
        raise PreflightError(violations)


def worker_env(config: RunConfig, kernel: Kernel) -> dict[str, str]:
    """Merge every plugin's ``unirl_worker_env`` (see :meth:`Kernel.worker_env`, where it lives so the
    runtime, which is below preflight, can call it)."""
    return kernel.worker_env(config)
