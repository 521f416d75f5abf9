"""Hook implementations. Keep this module light: no torch at import, factories as lazy strings,
so `unirl plugins` stays fast however many plugins are installed."""

from unirl.kernel import Violation, hookimpl


@hookimpl
def unirl_model_adapters():
    return {"example-llama": "unirl_example_adapter.adapter:LlamaAdapter"}


@hookimpl
def unirl_preflight(config, adapter):
    """Check what this adapter needs, only when the run selects it (``adapter`` is the built one)."""
    if config.model.adapter != "example-llama":
        return []
    if adapter is not None:
        head_dim = getattr(adapter.hf_config(config), "head_dim", None) or 32
    else:
        head_dim = config.model.build.get("head_dim", 32)
    if head_dim % 32:
        return [Violation("unirl-example-adapter", "model.build.head_dim",
                          f"{head_dim} is not a multiple of 32 (vLLM's CPU attention rejects it)", "use 32 or 64")]
    return []
