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
    tp = int(eargs.get("tensor_parallel_size", options.tensor_parallel_size))
    mode = str(eargs.get("logprobs_mode", options.logprobs_mode))
    # LoRA serving is tested with one worker per replica; TP ranks would each need the adapter's shards
    return EngineCapabilities(
        weight_syncs=("vllm",), logprobs="raw" if mode.startswith("raw_") else "processed",
        continuation=True, async_submit=True, lora_adapters=options.tensor_parallel_size == 1,
        # stream mode: jobs run one at a time (QueuedEngine); a paused engine loads once the running job
        # ended, and the queued jobs start under the new weights (none is submitted to vLLM before it runs)
        requests_across_sync="queued",
        routing_record=True,  # R3: its worker extension records the expert ids (unirl_vllm.routing)
        workers=int(options.replicas) * tp, tensor_parallel=tp, serve_dtype=dtype_name(eargs.get("dtype")),
        eager=bool(eargs.get("enforce_eager", options.enforce_eager)),
        prefix_cache=bool(eargs.get("enable_prefix_caching", options.enable_prefix_caching)),
        chunked_prefill=bool(eargs.get("enable_chunked_prefill", True)),  # vLLM V1's default is on
        logprobs_mode=mode, batching="continuous",  # vLLM's scheduler refills a finished row's slot each step
        # the option a user sets for each (engine_args may override it; chunked prefill is only there)
        fields=(("tensor_parallel", "rollout.options.tensor_parallel_size"),
                ("eager", "rollout.options.enforce_eager"), ("prefix_cache", "rollout.options.enable_prefix_caching"),
                ("chunked_prefill", "rollout.options.engine_args"), ("logprobs_mode", "rollout.options.logprobs_mode"),
                ("serve_dtype", "rollout.options.engine_args.dtype"), ("workers", "rollout.options.replicas")))
