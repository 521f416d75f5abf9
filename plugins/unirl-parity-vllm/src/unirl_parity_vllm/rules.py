"""The parity contract as a table of rules (:data:`RULES`), in the shape of core's ``INERT`` table.

Why data: each rule is one row (the field it names, when it applies, the check that finds the
violation, the fix), so a rule is read, added or removed in one place and every rule is reported in one
pass. Every fact about the engine and the actor comes from what they declare
(:class:`unirl.api.Capabilities`: workers, TP, serving dtype, switches, ranks, compute dtype,
compiled), never from their names or raw options; the names left are the verified lists of
:data:`~unirl_parity_vllm.profile.CONTRACT` (data: what this release was verified with).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from unirl.api import ActorCapabilities, Capabilities, EngineCapabilities, OptionsError, declared_capabilities
from unirl_parity_vllm import ENV_FLAG, profile
from unirl_parity_vllm.profile import (
    CONTRACT,
    ParityProfile,
    ParityRuntimeContract,
    _v,
    actor_of,
    declared,
    engine_of,
    family_violations,
    is_fingerprint,
    missing_extras,
    profile_of,
    registered_parity_adapters,
)


@dataclass(frozen=True)
class Run:
    """What every rule reads: the config, the declared profile (``want``), the profile the run has
    (``have``), the components' declarations and the model's config (None when it cannot be read)."""

    config: Any
    adapter: Any
    kernel: Any
    want: ParityProfile
    have: ParityProfile
    engine: EngineCapabilities
    actor: ActorCapabilities
    hf: Any = None

    @property
    def c(self) -> ParityRuntimeContract:
        return profile.CONTRACT  # read at check time (a test may swap it)

    @property
    def family(self) -> str | None:
        return getattr(self.adapter, "parity_adapter", None) if self.adapter is not None else None

    @property
    def tp(self) -> int:
        return self.engine.tensor_parallel


Text = str | Callable[[Run], str]


@dataclass(frozen=True)
class Rule:
    """One rule: ``check(run)`` returns the message when ``applies(run)`` and the run breaks it (else
    None); ``field`` and ``fix`` are text or functions of the run (the field the value came from)."""

    field: Text
    applies: Callable[[Run], bool]
    check: Callable[[Run], str | None]
    fix: Text


def _text(value: Text, run: Run) -> str:
    return value(run) if callable(value) else value


def _where(run: Run, *keys: str) -> str:
    """The field a model feature came from: the ``model.build`` key that set it, else the model."""
    given = [k for k in keys if k in (run.config.model.build or {})]
    return f"model.build.{given[0]}" if given else ("model.path" if run.config.model.path else "model")


def _rope(run: Run) -> str:
    return (getattr(run.hf, "rope_parameters", None) or {}).get("rope_type", "default")


def _dtype_problem(run: Run) -> str | None:
    dtype, c = run.config.model.dtype, run.c
    path = (run.config.rollout.engine, run.config.actor.name)
    if dtype in c.dtypes or (dtype == "bfloat16" and path in c.bf16_paths):
        return None  # verified: bf16 compute on fp32 master weights on the listed engine and actor
    if dtype in c.experimental_dtypes and run.want.experimental:
        return None
    if dtype in c.experimental_dtypes:
        where = ", ".join(f"(rollout.engine {e}, actor.name {a})" for e, a in c.bf16_paths)
        return (f"{dtype} parity is experimental with rollout.engine {path[0]} and actor.name {path[1]}: it is "
                f"verified on {where} only (docs/parity.md, bf16)")
    return f"{dtype} is not supported"


def _dtype_fix(run: Run) -> str:
    if run.config.model.dtype in run.c.experimental_dtypes:
        return ("use model.dtype: float32, or a verified engine and actor (recipes/parity-tiny-bf16-embedded.yaml, "
                "recipes/parity-tiny-bf16.yaml), or set plugins.parity.experimental: true to measure it")
    return "float32"


def _tp_problem(run: Run) -> str | None:
    c, tp = run.c, run.tp
    sizes = ", ".join(map(str, c.tensor_parallel_sizes))
    gpu_experimental = run.want.platform == "cuda" and run.want.experimental and tp in c.experimental_tensor_parallel_sizes
    if tp not in c.tensor_parallel_sizes and not gpu_experimental:
        return f"tensor_parallel_size {tp}: parity is verified with {sizes} only"
    if tp > 1 and run.family not in c.tensor_parallel_adapters:
        return (f"tensor_parallel_size {tp} with model family {run.family!r}: parity with TP > 1 is verified for "
                f"{', '.join(c.tensor_parallel_adapters)} only (its vLLM side must make every sharded reduction "
                "shard-invariant)")
    return None


def _tp_fix(run: Run) -> str:
    if run.tp not in run.c.tensor_parallel_sizes:
        return f"set tensor_parallel_size to one of {', '.join(map(str, run.c.tensor_parallel_sizes))}"
    return "set tensor_parallel_size: 1"


def _engine_known(run: Run) -> bool:
    return run.config.rollout.engine in run.c.engines


def _switch_rule(switch: str) -> Rule:
    """An engine switch the engine side needs (:attr:`ParityRuntimeContract.engine_switches`), checked
    where the engine declares that switch; named by the engine's own option."""
    def name(run: Run) -> str:
        return run.engine.field_of(switch, f"rollout.options.{switch}").rsplit(".", 1)[-1]

    def check(run: Run) -> str | None:
        got, want = getattr(run.engine, switch), run.c.engine_switches[switch]
        return None if got == want else f"{name(run)}={got!r} is not supported with parity (needs {want!r})"

    return Rule(lambda run: run.engine.field_of(switch, f"rollout.options.{switch}"),
                lambda run: getattr(run.engine, switch) is not None, check,
                lambda run: f"set {name(run)}: {run.c.engine_switches[switch]}")


_SERVE_DTYPE = ("the engine would serve {served} weights while the actor replays in model.dtype {dtype}: the replay "
                "would not compute on the bytes the engine serves (vLLM refuses the first sync by dtype only after "
                "it has started; docs/parity.md, bf16)")
_COMPUTE_DTYPE = ("compute_dtype {cd} with model.dtype {dtype}: under parity the actor computes in the dtype the "
                  "engine serves (model.dtype; bf16 compute on fp32 master weights is model.dtype: bfloat16 with "
                  "compute_dtype unset, recipes/parity-tiny-bf16.yaml), the one mixed-precision setup the profile "
                  "verifies")

#: The supported contract (:data:`~unirl_parity_vllm.profile.CONTRACT`) as rules, in report order.
RULES: tuple[Rule, ...] = (
    Rule("plugins.parity.enabled", lambda run: True,
         lambda run: None if run.want.enabled else f"{ENV_FLAG}=1 but the recipe does not opt in to parity",
         "add plugins: {parity: {enabled: true}} (recipes/parity-tiny.yaml) or unset the flag"),
    # the actor's LoRA forward (W x + s B A x) is not the engine's merged W' x
    Rule("actor.lora", lambda run: run.config.actor.lora is not None,
         lambda run: ("LoRA is not supported under the parity gate: the actor computes W x + (alpha / r) B (A x) "
                      "while the engine serves the merged weights, so the log-probs differ in the last bits"),
         "remove actor.lora (full fine-tuning), or disable parity (plugins.parity)"),
    Rule("plugins.parity.model.fingerprint",
         lambda run: run.want.model.fingerprint is not None,
         lambda run: (None if is_fingerprint(fp := run.want.model.fingerprint) else
                      f"{fp!r} is not a weights fingerprint (64 lowercase hex digits, sha256)"),
         "copy the fingerprint of a run's initial publish (RUN_DIR/weights.log, version 1, or the artifact's "
         "weights[0].receipts), or remove it"),
)

#: Rules on the model's architecture (read from the adapter's model config), after the family's.
MODEL_RULES: tuple[Rule, ...] = (
    Rule(lambda run: _where(run, "rope_parameters", "rope_scaling"), lambda run: True,
         lambda run: (None if (rope := _rope(run)) in run.c.rope_types else
                      f"RoPE type {rope!r} is not supported by the reference ops ({', '.join(run.c.rope_types)})"),
         "use a model with default RoPE"),
    Rule(lambda run: _where(run, "hidden_act"), lambda run: True,
         lambda run: (None if (act := getattr(run.hf, "hidden_act", "silu")) in run.c.hidden_acts else
                      f"hidden_act {act!r} is not supported by the reference ops ({', '.join(run.c.hidden_acts)})"),
         "use a model with hidden_act: silu"),
    Rule(lambda run: _where(run, "layer_types", "use_sliding_window", "sliding_window"), lambda run: True,
         lambda run: (None if not (kinds := sorted(set(getattr(run.hf, "layer_types", None) or [])
                                                   - {"full_attention"})) else
                      f"layer types {kinds} (sliding window) are not supported by the reference attention"),
         "use a model whose layers are all full_attention"),
)

#: Rules on the engine, the actor and the training loop, from what they declare.
LAYOUT_RULES: tuple[Rule, ...] = (
    Rule("model.dtype", lambda run: True, _dtype_problem, _dtype_fix),
    Rule("rollout.engine", lambda run: True,
         lambda run: None if _engine_known(run) else f"engine {run.config.rollout.engine!r} has no parity installer",
         lambda run: f"set rollout.engine to one of: {', '.join(run.c.engines)}"),
    Rule("weight_sync.name", _engine_known,
         lambda run: (None if (s := run.config.weight_sync.name) == run.c.weight_syncs[run.config.rollout.engine]
                      else f"{s!r} is not the verified sync for {run.config.rollout.engine}"),
         lambda run: f"set weight_sync.name: {run.c.weight_syncs[run.config.rollout.engine]}"),
    Rule("actor.name", lambda run: True,
         lambda run: (None if run.config.actor.name in run.c.actors else
                      f"actor {run.config.actor.name!r} does not enter the parity context"),
         lambda run: f"set actor.name to one of: {', '.join(run.c.actors)}"),
    Rule(lambda run: run.actor.field_of("compute_dtype", "actor.options.compute_dtype"),
         lambda run: run.actor.compute_dtype not in (None, run.config.model.dtype),
         lambda run: _COMPUTE_DTYPE.format(cd=run.actor.compute_dtype, dtype=run.config.model.dtype),
         "leave compute_dtype unset"),
    Rule(lambda run: run.actor.field_of("compiled", "actor.options.compile"), lambda run: run.actor.compiled,
         lambda run: ("torch.compile fuses the MLP and RMSNorm ops into kernels of its own, whose bits are not "
                      "those of the ops the profile verifies"), "leave actor.options.compile unset"),
    Rule(lambda run: run.engine.field_of("serve_dtype"),
         lambda run: run.engine.serve_dtype not in (None, run.config.model.dtype),
         lambda run: _SERVE_DTYPE.format(served=run.engine.serve_dtype, dtype=run.config.model.dtype),
         lambda run: f"remove it (the engine follows model.dtype), or set model.dtype: {run.engine.serve_dtype}"),
    Rule("algorithm.updates_per_batch", lambda run: run.config.algorithm.updates_per_batch != 1,
         lambda run: (f"{run.config.algorithm.updates_per_batch} updates per batch: after the first, the replay is "
                      "compared with a policy that moved, so the gate cannot hold"), "set it to 1"),
    Rule(lambda run: run.engine.field_of("tensor_parallel", "rollout.options.tensor_parallel_size"),
         lambda run: True, _tp_problem, _tp_fix),
    *(_switch_rule(switch) for switch in CONTRACT.engine_switches),
)


def run_rules(rules: tuple[Rule, ...], run: Run) -> list:
    """One violation per rule that applies and fails, in table order."""
    out = []
    for rule in rules:
        if rule.applies(run) and (message := rule.check(run)) is not None:
            out.append(_v(_text(rule.field, run), message, _text(rule.fix, run)))
    return out


def platform_violations(config: Any, want: ParityProfile) -> list:
    """``platform: cuda`` needs an engine with a CUDA parity path (the torch engine has none) and a CUDA
    device in this process (checked here, before Ray or vLLM start; the vLLM side checks its own)."""
    if want.platform != "cuda":
        return []
    out = []
    if config.rollout.engine not in profile.CONTRACT.cuda_engines:
        out.append(_v("plugins.parity.platform", f"cuda with rollout.engine {config.rollout.engine!r}: the CUDA "
                      "parity ops are vLLM-side only", "set rollout.engine: vllm, or plugins.parity.platform: cpu"))
    import torch

    if not torch.cuda.is_available():
        out.append(_v("plugins.parity.platform", "cuda, but torch sees no CUDA device here",
                      "run on a GPU machine with the pinned GPU vLLM (make install-gpu), or set "
                      "plugins.parity.platform: cpu"))
    return out


def profile_violations(run: Run) -> list:
    """Declared profile fields against the run (a field given must match what the run has)."""
    out, want, have = [], run.want, run.have
    for section in ("model", "topology", "sampling", "engine_switches"):
        w, h = getattr(want, section).model_dump(), getattr(have, section).model_dump()
        for k, v in w.items():
            if v is not None and v != h.get(k) and not (section == "model" and k == "fingerprint"):
                out.append(_v(f"plugins.parity.{section}.{k}", f"profile says {v!r}, the run has {h.get(k)!r}",
                              "make the recipe match its profile"))
    out += logprobs_violations(run)
    for name, field in (("dtype", "model.dtype"), ("weight_sync", "weight_sync.name")):
        w, h = getattr(want, name), getattr(have, name)
        if w is not None and w != h:
            out.append(_v(field, f"profile says {w!r}, the run has {h!r}", "make the recipe match its profile"))
    for pkg, v in want.packages.items():
        found = profile._version(pkg) if pkg != "vllm" else profile.vllm_version()
        if found != v:
            out.append(_v(f"plugins.parity.packages.{pkg}", f"profile pins {pkg}=={v}, installed: {found}",
                          f"pip install {pkg}=={v}"))
    return out


def logprobs_violations(run: Run) -> list:
    """The log-prob distribution: a mode of :data:`CONTRACT` (``processed_logprobs`` by default, or
    ``raw_logprobs``), the one the profile declares, and nothing the actor's replay cannot reproduce."""
    config, mode, modes = run.config, run.engine.served_logprobs, run.c.logprobs_modes
    field = run.engine.field_of("logprobs_mode", "rollout.logprobs")
    fix_to = (f"set {field}: {{m}} (and rollout.logprobs: {{k}})" if field != "rollout.logprobs" else
              "set rollout.logprobs: {k}")
    if mode not in modes:
        return [_v(field, f"logprobs_mode {mode!r} is not supported with parity: the gate compares fp32 log-probs "
                   f"({', '.join(modes)}), and *_logits modes return logits",
                   fix_to.format(m=modes[0], k="processed"))]
    out = []
    if run.want.logprobs_mode is not None and run.want.logprobs_mode != run.have.logprobs_mode:
        m = run.want.logprobs_mode
        out.append(_v("plugins.parity.logprobs_mode", f"profile says {m!r}"
                      f"{' (the default)' if m == modes[0] else ''}, the run has {mode!r}",
                      fix_to.format(m=m, k=m.split("_")[0]) + f", or declare plugins.parity.logprobs_mode: {mode}"))
    if mode.startswith("processed") and config.rollout.min_new_tokens > 0:
        out.append(_v("rollout.min_new_tokens", f"min_new_tokens {config.rollout.min_new_tokens} with "
                      "processed log-probs: the engine bans eos before processing, and the replay cannot know "
                      "which turn steps were banned", "set rollout.min_new_tokens: 0, or use raw_logprobs"))
    return out


def package_violations(run: Run) -> list:
    """Strict mode: every package the engine side runs in at a verified version prefix."""
    out, engine = [], run.config.rollout.engine
    for pkg, prefix in run.c.packages.items():
        if pkg in run.c.engine_packages.values() and run.c.engine_packages.get(engine) != pkg:
            continue  # another engine's package
        found = profile.vllm_version() if pkg == "vllm" else profile._version(pkg)
        if found is None or (run.want.strict and not found.startswith(prefix)):
            out.append(_v("packages", f"{pkg} {found} is not a verified version ({prefix}*) and the profile is "
                          "strict (plugins.parity.strict: true, the default)",
                          f"install {pkg} {prefix}*, or set plugins.parity.strict: false to run an unverified "
                          "version whose symbols and ops still check (docs/parity.md, strict mode)"))
    return out


def _model_config(config: Any, adapter: Any, kernel: Any) -> tuple[Any, list]:
    """The model's (text) config when the family has reference ops to check it against, else None."""
    pname = getattr(adapter, "parity_adapter", None) if adapter is not None else None
    if not (adapter is not None and pname and (pname in profile.CONTRACT.parity_adapters
                                               or pname in registered_parity_adapters(kernel))):
        return None, []
    try:
        hf = adapter.hf_config(config)
    except Exception as exc:  # noqa: BLE001 - core preflight reports broken adapters
        return None, [_v("model", f"cannot read the model config: {exc}")]
    return getattr(hf, "text_config", None) or hf, []


def contract_violations(config: Any, adapter: Any, kernel: Any, capabilities: Capabilities | None = None) -> list:
    """Every way the run breaks the recipe's profile or :data:`CONTRACT` (empty: it may proceed)."""
    out = [] if os.environ.get(ENV_FLAG) == "1" else [_v("env", f"{ENV_FLAG} is not 1", f"export {ENV_FLAG}=1")]
    try:
        want = declared(config, kernel)
    except OptionsError as exc:  # the recipe's section, as the kernel validated it
        return out + [_v(v.field, with_input(v.field, v.message, config),
                         f"fields of plugins.parity: {', '.join(ParityProfile.model_fields)} (docs/parity.md)")
                      for v in exc.violations]
    except ValidationError as exc:  # the fields the profile file adds
        return out + [_v(".".join(["plugins.parity", *map(str, e["loc"])]), f"{e['msg']} (got {e.get('input')!r})",
                         f"fields of plugins.parity: {', '.join(ParityProfile.model_fields)} (docs/parity.md)")
                      for e in exc.errors()]
    except (OSError, ValueError) as exc:
        return out + [_v("plugins.parity.profile", f"cannot read the profile file: {exc}",
                         "point plugins.parity.profile at a readable YAML file, or remove it")]
    caps = capabilities if capabilities is not None else declared_capabilities(config, kernel)
    out += platform_violations(config, want)
    hf, unreadable = _model_config(config, adapter, kernel)
    run = Run(config, adapter, kernel, want, profile_of(config, capabilities=caps), engine_of(config, caps),
              actor_of(caps), hf)
    out += run_rules(RULES, run) + profile_violations(run)
    pname = run.family
    out += family_violations(config, pname, want, kernel) if adapter is not None else []
    out += unreadable + (run_rules(MODEL_RULES, run) if hf is not None else [])
    return out + run_rules(LAYOUT_RULES, run) + package_violations(run)


def with_input(field: str, message: str, config: Any) -> str:
    """A section violation's message with the value the recipe gave at ``field`` (``plugins.parity.<loc>``),
    as the profile's errors always said it."""
    if "(got " in message:
        return message
    node: Any = (getattr(config, "plugins", None) or {}).get("parity")
    for part in field.split(".")[2:]:
        node = node.get(part) if isinstance(node, dict) else None
    return f"{message} (got {node!r})"


def preflight(config: Any, adapter: Any, kernel: Any, capabilities: Capabilities | None = None) -> list:
    # the contract below reads the engine's declarations and versions: without the extras there is nothing
    # to check them against, and the install line is the one thing to say
    return missing_extras(config) or contract_violations(config, adapter, kernel, capabilities)
