"""FSDP declares its ranks and compute dtype (issue 72) from its validated options: nobody assumes
the default world size."""

from __future__ import annotations

from unirl.api import ActorCapabilities, RunConfig
from unirl_fsdp.actor import FSDPActor
from unirl_fsdp.options import FSDPOptions


def test_ranks_and_compute_dtype_come_from_the_options():
    assert FSDPActor.capabilities(RunConfig(), FSDPOptions()) == ActorCapabilities(ranks=FSDPOptions().world_size)
    caps = FSDPActor.capabilities(RunConfig(), FSDPOptions(world_size=4, compute_dtype="bfloat16"))
    assert (caps.ranks, caps.compute_dtype, caps.compiled) == (4, "bfloat16", False)
    assert caps.field_of("ranks") == "actor.options.world_size"
