"""What the vLLM engine declares (``RolloutEngine.capabilities``): pairings and the layout it runs with.

Why here, read from the validated options the way :meth:`VLLMEngine._llm_kwargs` applies them
(``engine_args`` last, as vLLM takes them): preflight, the memory plan and other plugins (parity) read
these facts instead of importing this plugin's options or re-deriving them from raw config.
"""

from __future__ import annotations

from typing import Any

from unirl.api import EngineCapabilities, dtype_name


def vllm_capabilities(cls: type, config: Any, options: Any) -> EngineCapabilities:
    eargs = dict(options.engine_args or {})

    def applied(key: str, value: Any) -> tuple[Any, str]:  # the value vLLM gets, and the field it came from
        return (eargs[key], "rollout.options.engine_args") if key in eargs else (value, f"rollout.options.{key}")

    tp, tp_field = applied("tensor_parallel_size", options.tensor_parallel_size)
    eager, eager_field = applied("enforce_eager", options.enforce_eager)
    prefix, prefix_field = applied("enable_prefix_caching", options.enable_prefix_caching)
    mode, mode_field = applied("logprobs_mode", options.logprobs_mode)
    # LoRA serving is tested with one worker per replica; TP ranks would each need the adapter's shards
    return EngineCapabilities(
        weight_syncs=("vllm",), logprobs="raw" if str(mode).startswith("raw_") else "processed",
        continuation=True, async_submit=True, lora_adapters=options.tensor_parallel_size == 1,
        workers=int(options.replicas) * int(tp), tensor_parallel=int(tp), serve_dtype=dtype_name(eargs.get("dtype")),
        eager=bool(eager), prefix_cache=bool(prefix),
        chunked_prefill=bool(eargs.get("enable_chunked_prefill", True)),  # vLLM V1's default is on
        logprobs_mode=str(mode),
        fields=(("tensor_parallel", tp_field), ("eager", eager_field), ("prefix_cache", prefix_field),
                ("chunked_prefill", "rollout.options.engine_args"), ("logprobs_mode", mode_field),
                ("serve_dtype", "rollout.options.engine_args.dtype")))
