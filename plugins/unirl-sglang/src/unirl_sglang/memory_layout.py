"""SGLang's declared memory (``RolloutEngine.memory_layout``, the memory plan): the servers are processes
UniRL does not place (given by URL, or launched with their own ``--mem-fraction-static``), so their
weights are shown as ``external`` loads, not checked against this host's budget; the trainer's side of a
sync (a safetensors export streamed in buckets) is not model-sized."""

from __future__ import annotations

from typing import Any

from unirl.api import DTYPE_BYTES, DeviceLoad, MemoryItem, MemoryLayout, ModelFacts


def sglang_layout(cls: type, config: Any, options: Any, facts: ModelFacts) -> MemoryLayout:
    dtype = config.model.dtype
    servers = cls.capabilities(config, options).workers  # one source: each server its declared worker
    weights = MemoryItem(f"engine weights ({dtype})", facts.params * DTYPE_BYTES[dtype],
                         f"{facts.params:,} params; KV cache: the server's own --mem-fraction-static")
    return MemoryLayout(tuple(DeviceLoad(f"sglang server {j}", "external", (weights,)) for j in range(servers)))
