"""vLLM's declared memory (``RolloutEngine.memory_layout``, the memory plan).

Per TP worker: the weights in the serving dtype (``model.dtype``), a 1/TP slice each. On a GPU vLLM takes
``gpu_memory_utilization`` of the card's memory in all (weights, KV cache, its workspace), so the plan
counts that whole reservation, split into weights and the rest. On the CPU the KV cache is
``kv_cache_gb`` (else ``VLLM_CPU_KVCACHE_SPACE``: 1 GiB, which the plugin sets). In the trainer's process
the weight sync streams ``bucket_mb`` buckets (a bucket being filled and one being loaded).
Fix it declares (GPU): a lower ``gpu_memory_utilization``.
"""

from __future__ import annotations

from typing import Any

from unirl.api import DTYPE_BYTES, DeviceLoad, MemoryFix, MemoryItem, MemoryLayout, ModelFacts

GB, MB = 1 << 30, 1 << 20


def _gpu_total(config: Any) -> int | None:
    if config.run.memory_budget_gb is not None:
        return int(config.run.memory_budget_gb * GB)
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None


def vllm_layout(cls: type, config: Any, options: Any, facts: ModelFacts) -> MemoryLayout:
    declared = cls.capabilities(config, options)  # one source: TP and serving dtype as vLLM applies them
    served = declared.serve_dtype  # engine_args.dtype; a value the plan cannot size (auto) follows model.dtype
    tp, dtype = declared.tensor_parallel, served if served in DTYPE_BYTES else config.model.dtype
    weights = facts.params * DTYPE_BYTES[dtype] // tp
    w_item = MemoryItem(f"engine weights ({dtype})", weights, f"{facts.params:,} params / TP {tp}")
    staging = MemoryItem("sync staging (2 buckets)", int(2 * options.bucket_mb * MB), f"bucket_mb {options.bucket_mb:g}")
    trainer: tuple[MemoryItem, ...] = (staging,)
    if options.keep_committed_copy:  # the last committed weights, kept for recovery (unirl_vllm.committed)
        trainer += (MemoryItem("recovery copy (keep_committed_copy)", facts.params * DTYPE_BYTES[dtype],
                               "the last committed weights, kept in memory"),)
    loads = [DeviceLoad("trainer", "host", trainer)]
    fixes: list[MemoryFix] = []
    if facts.accelerator:
        total = _gpu_total(config)
        rest = max(0, int(options.gpu_memory_utilization * total) - weights) if total else 0
        kv = MemoryItem("KV cache + workspace", rest, f"gpu_memory_utilization {options.gpu_memory_utilization:g} "
                        "x device, less the weights" if total else "unknown: no device memory known")
        loads += [DeviceLoad(f"gpu:{j}", "gpu", (w_item, kv)) for j in range(tp)]
        if options.gpu_memory_utilization > 0.2:
            fixes.append(MemoryFix("rollout.options.gpu_memory_utilization",
                                   round(options.gpu_memory_utilization / 2, 2), "a smaller vLLM reservation"))
    else:
        kv_gb = options.kv_cache_gb if options.kv_cache_gb is not None else 1.0
        kv = MemoryItem("KV cache", int(kv_gb * GB), f"kv_cache_gb {kv_gb:g} (VLLM_CPU_KVCACHE_SPACE)")
        loads += [DeviceLoad(f"engine worker {j}", "host", (w_item, kv)) for j in range(tp)]
    return MemoryLayout(tuple(loads), tuple(fixes))
