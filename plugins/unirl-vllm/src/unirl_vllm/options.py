"""The ``rollout.options`` of the ``vllm`` engine, as a pydantic model.

Kept apart from :mod:`unirl_vllm.engine` so preflight can validate a recipe without importing vLLM
or torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]


class VLLMOptions(BaseModel):
    """Engine options (``rollout.options.*`` when ``rollout.engine: vllm``)."""

    model_config = ConfigDict(extra="forbid")

    placement: Literal["inprocess", "ray"] = Field(
        "inprocess", description="run vllm.LLM in the trainer's process, or inside one Ray actor"
    )
    logprobs_mode: LogprobsMode = Field(
        "raw_logprobs",
        description="what vLLM returns as the sampled token's log-prob; 'raw_logprobs' is what the "
        "actor's replay computes (log_softmax before temperature/top-p/top-k)",
    )
    enforce_eager: bool = Field(True, description="no CUDA graphs / torch.compile of the model")
    kv_cache_gb: float | None = Field(None, gt=0, description="KV cache size in GiB; None: vLLM's default")
    max_model_len: int | None = Field(None, gt=0, description="None: the model's max_position_embeddings")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="GPU only; ignored on the CPU")
    tensor_parallel_size: int = Field(1, ge=1, description="GPU only; the CPU tests run 1")
    seed: int | None = Field(None, description="engine seed; None: run.seed")
    enable_prefix_caching: bool = True
    skip_tokenizer_init: bool | None = Field(
        None, description="None: skip when the model directory has no tokenizer (stop strings then fail)"
    )
    ignore_eos: bool = Field(False, description="never stop at EOS (benchmarks: fixed token counts)")
    ray_num_cpus: float = Field(1, ge=0, description="CPUs reserved for the Ray actor (placement: ray)")
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="extra vllm.LLM keyword arguments, applied last"
    )
