"""The options of the ``fsdp`` actor (``actor.options`` in a recipe), validated by pydantic.

Kept apart from :mod:`unirl_fsdp.actor` so that preflight can validate a recipe without importing
torch or Ray. Everything that differs between the CPU run (gloo) and a GPU cluster (NCCL) is here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from unirl.api import Placement, StrictOptions


class FSDPOptions(StrictOptions):
    """``actor.options`` of ``actor.name: fsdp``."""

    model_config = ConfigDict(extra="forbid")

    world_size: int = Field(2, ge=1, description="number of ranks (one Ray actor each)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: cuda when the Ray cluster has world_size GPUs, else cpu")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend; auto: nccl on cuda, gloo on cpu")
    compute_dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="dtype of forward/backward (FSDP param_dtype); None: model.dtype. "
                          "Master weights, gradients and optimizer state stay float32")
    cpu_offload: bool = Field(False, description="keep sharded params/grads/optimizer on the CPU "
                                                 "(FSDP2 CPUOffloadPolicy); only meaningful on cuda")
    reshard_after_forward: bool = Field(True, description="free gathered params after forward (ZeRO-3); "
                                                          "False keeps them until backward (ZeRO-2)")
    keep_groups: bool | None = Field(
        None, description="keep a group's siblings on one rank; None: when the run's advantage estimator "
                          "declares needs_groups (grpo, dr_grpo, rloo)")
    bucket_mb: float = Field(64.0, gt=0, description="size of a weight-export bucket (MiB): the weight "
                                                  "stream's, and one file of an export")
    cpus_per_rank: float = Field(1.0, gt=0, description="Ray CPUs reserved per rank")
    threads_per_rank: int | None = Field(None, ge=1, description="torch threads per rank; "
                                                                 "None: max(1, int(cpus_per_rank))")
    step_timeout_s: float = Field(600.0, gt=0, description="a call that takes longer fails the group")
    init_timeout_s: float = Field(180.0, gt=0, description="placement + rendezvous + model build")
    placement: Placement = Field(
        default_factory=Placement,
        description="which Ray nodes host the ranks (custom resources, node labels) and how they spread "
                    "(strategy; default PACK: one node first). See docs/cluster.md")
    ray_address: str | None = Field(None, description="Ray cluster to join; None: RAY_ADDRESS, "
                                                      "else a local Ray on loopback")
    worker_cls: str | None = Field(
        None, pattern=r"^[\w.]+:[\w.]+$",
        description="for tests and drills only: 'module:Class', a subclass of unirl_fsdp.worker.FSDPWorker "
                    "that each rank runs instead (fault injection, gradient and memory probes; see the "
                    "plugin's tests/fsdp_support.py). The module must be importable in the driver; its "
                    "sys.path root is handed to the ranks. None: FSDPWorker")
