"""The FSDP actor's held weight versions (the mismatch diagnostics' staleness term, docs/mismatch.md), for
real: gloo, 2 ranks (Ray actors), CPU, fp32.

Each rank keeps its own shards of a version on the CPU (``unirl.actor.held_versions``). The oracle is
the actor's own replay before the update: a replay at the held version after two updates must give it
bit for bit, and the live weights must be back bit for bit afterwards (the replay of the moved weights is
unchanged).
"""

from __future__ import annotations

import random

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

import fsdp_support  # noqa: E402

from unirl.api import (  # noqa: E402
    Qwen3Adapter,
    RunConfig,
    Sample,
    StepInfo,
    build_actor,
    build_runtime,
    load_kernel,
)

pytestmark = pytest.mark.ray


@pytest.mark.slow
def test_fsdp_ranks_replay_bitwise_at_a_held_version_and_restore_their_shards(ray_session):
    config = RunConfig.model_validate({
        "model": {"build": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
                            "num_key_value_heads": 1}},
        "actor": {"name": "fsdp", "lr": 3e-3, "micro_batch_size": 2,
                  "options": {"world_size": 2, "cpus_per_rank": 0.5, "step_timeout_s": 120,
                              "worker_cls": fsdp_support.WORKER_CLS}},
    })
    rng = random.Random(0)
    samples = [Sample(id=f"p{g}/{k}", prompt_ids=[rng.randrange(3, 259) for _ in range(5)],
                      response_ids=[rng.randrange(3, 259) for _ in range(6)]) for g in range(3) for k in range(2)]
    gen = torch.Generator().manual_seed(1)
    adv = [torch.randn(len(s.response_ids), generator=gen) for s in samples]
    actor = build_actor(config, adapter=Qwen3Adapter(),
                        runtime=build_runtime(config, load_kernel(), adapter=Qwen3Adapter(), worker_env={}))
    try:
        at_start = actor.logprobs(samples)
        actor.hold_version(1, keep={0, 1})
        for k in range(2):
            actor.train_step(samples, {"advantages": adv}, StepInfo(rl_step=k))
        actor.hold_version(2, keep={1, 2})  # version 0 was never held; 1 stays
        moved = actor.logprobs(samples)
        assert max(float((a - b).abs().max()) for a, b in zip(at_start, moved, strict=True)) > 1e-3  # it did move
        assert all(torch.equal(a, b) for a, b in zip(actor.logprobs_at(1, samples), at_start, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(actor.logprobs_at(2, samples), moved, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(actor.logprobs(samples), moved, strict=True))  # shards back
        with pytest.raises(Exception, match="weight version 0 is not held"):
            actor.logprobs_at(0, samples)
    finally:
        actor.close()
