"""Hook implementations. Keep this module light: no torch at import, factories as lazy strings,
so `unirl plugins` stays fast however many plugins are installed."""

import importlib.util
import os

from unirl.api import Violation, hookimpl


@hookimpl
def unirl_model_adapters():
    return {"example-llama": "unirl_example_adapter.adapter:LlamaAdapter"}


def _parity_installed() -> bool:
    return importlib.util.find_spec("unirl_parity_vllm") is not None  # finds it, imports nothing


@hookimpl
def unirl_parity_providers():
    """Bitwise parity for this family (``parity.py``, built on unirl-parity-vllm's reference ops), under
    the name ``LlamaAdapter.parity_adapter`` gives. Registered only when unirl-parity-vllm is installed
    (the optional ``[parity]`` extra), so the adapter never needs it."""
    if not _parity_installed():
        return {}
    return {"example-llama": "unirl_example_adapter.parity:LlamaParityProvider"}


@hookimpl
def unirl_preflight(config, adapter):
    """Check what this adapter needs, only when the run selects it (``adapter`` is the built one)."""
    if config.model.adapter != "example-llama":
        return []
    if adapter is not None:
        head_dim = getattr(adapter.hf_config(config), "head_dim", None) or 32
    else:
        head_dim = config.model.build.get("head_dim", 32)
    out = []
    if head_dim % 32:
        out.append(Violation("unirl-example-adapter", "model.build.head_dim",
                             f"{head_dim} is not a multiple of 32 (vLLM's CPU attention rejects it)", "use 32 or 64"))
    parity = (config.plugins or {}).get("parity") or {}
    if os.environ.get("UNIRL_PARITY_ENABLE") == "1" and parity.get("enabled") and \
            config.rollout.engine not in ("torch", "vllm"):
        out.append(Violation("unirl-example-adapter", "rollout.engine",
                             f"example-llama parity has no {config.rollout.engine!r} installer (torch and vllm only)",
                             "use rollout.engine: torch or vllm"))
    return out
