"""The embedded engine's declared memory (:meth:`unirl.contracts.RolloutEngine.memory_layout`): its own
copy of the weights in the serving dtype and the KV cache of one batch, in the trainer's process."""

from __future__ import annotations

from typing import Any

from unirl.config import RunConfig
from unirl.memory_plan.layout import DTYPE_BYTES, DeviceLoad, MemoryItem, MemoryLayout, ModelFacts


def kv_bytes_per_token(facts: ModelFacts, dtype: str) -> int:
    """K and V of one token across every layer."""
    return facts.layers * 2 * facts.kv_heads * facts.head_dim * DTYPE_BYTES[dtype]


def torch_engine_layout(cls: type, config: RunConfig, options: Any, facts: ModelFacts) -> MemoryLayout:
    dtype = cls.capabilities(config, options).serve_dtype or config.model.dtype  # one source: its declaration
    batch = getattr(options, "batch_size", 64)
    seq = config.data.max_prompt_tokens + config.rollout.max_new_tokens
    weights = MemoryItem(f"weights ({dtype})", facts.params * DTYPE_BYTES[dtype], f"{facts.params:,} params")
    kv = MemoryItem("KV cache (1 batch)", batch * seq * kv_bytes_per_token(facts, dtype),
                    f"{batch} seqs x {seq} tokens")
    return MemoryLayout((DeviceLoad("trainer", "host", (weights, kv)),))
