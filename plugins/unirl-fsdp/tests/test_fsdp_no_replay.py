"""Issue 10's no-replay shortcut on the FSDP actor, for real: gloo, 2 ranks (Ray actors), CPU, fp32.

Like the embedded actor's ``core/tests/test_step_speed.py``: a train step without ``old_logprobs``
(each micro-batch's own detached forward is pi_old) must give **bitwise** the loss and full gradients
of the step whose ``old_logprobs`` are replayed on the same plan (the training's shards and micro-batch
count). Several micro-batches per rank, and a rank that pads, are included.

The actor's own replay (``actor.logprobs``) shards by tokens without keeping groups, so its micro-batches
differ from the training's and its pi_old agrees only to packing invariance (< 1e-6, measured ~1e-8 in
the loss): the shortcut is the exact one.
"""

from __future__ import annotations

import random

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

import fsdp_support  # noqa: E402
from fsdp_support import loss_and_grads  # noqa: E402

from unirl.api import (  # noqa: E402
    Qwen3Adapter,
    RunConfig,
    Sample,
    build_actor,
    build_runtime,
    load_kernel,
)

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("size,tokens", [(2, None), (4, 20)], ids=["by-count", "by-tokens"])
def test_fsdp_train_step_without_old_logprobs_is_bitwise_the_replayed_step(ray_session, size, tokens):
    """``by-tokens``: ``actor.micro_batch_tokens`` cuts each rank's samples unevenly, so the driver's plan
    (the busiest rank's count) must count as the ranks cut, or a rank refuses the plan."""
    config = RunConfig.model_validate({
        "model": {"build": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
                            "num_key_value_heads": 1}},
        "actor": {"name": "fsdp", "lr": 1e-3, "micro_batch_size": size, "micro_batch_tokens": tokens, "grad_clip": 1.0,
                  "options": {"world_size": 2, "cpus_per_rank": 0.5, "step_timeout_s": 120,
                              "worker_cls": fsdp_support.WORKER_CLS}},
        "algorithm": {"clip_high": 0.28},
    })
    rng = random.Random(0)
    samples = []
    for g in range(5):  # 5 groups over 2 ranks: 3 vs 2 groups, so one rank runs a padding micro-batch
        prompt = [rng.randrange(3, 259) for _ in range(rng.randrange(3, 9))]
        for k in range(2):
            m = rng.randrange(2, 9)
            mask = [1] * m
            mask[rng.randrange(m)] = 0
            samples.append(Sample(id=f"p{g}/{k}", prompt_ids=prompt, loss_mask=mask,
                                  response_ids=[rng.randrange(3, 259) for _ in range(m)]))
    gen = torch.Generator().manual_seed(1)
    adv = [torch.randn(len(s.response_ids), generator=gen) for s in samples]
    actor = build_actor(config, adapter=Qwen3Adapter(),
                        runtime=build_runtime(config, load_kernel(), adapter=Qwen3Adapter(), worker_env={}))
    try:
        shards = actor._shard(samples)
        assert sorted(len(s) for s in shards) == [4, 6]
        if tokens is not None:  # the budget, not the count, sets the plan
            assert actor._num_micro(samples, shards) > max(-(-len(s) // size) for s in shards)
        # the oracle: pi_old replayed on the training's own plan (its shards and micro-batch count)
        outs = actor.group.call("logprobs", per_rank=[([samples[i] for i in idx], actor._num_micro(samples, shards))
                                                      for idx in shards])
        old = [None] * len(samples)
        for idx, out in zip(shards, outs, strict=True):
            for i, t in zip(idx, out, strict=True):
                old[i] = t
        # the trainer's replay balances tokens without keeping groups: other micro-batches, same numbers
        # to packing invariance (not bitwise), which is why the oracle above replays on the training plan
        balanced = actor.logprobs(samples)
        assert max(float((a - b).abs().max()) for a, b in zip(old, balanced, strict=True)) < 1e-6
        loss_r, grads_r = loss_and_grads(actor, samples, {"advantages": adv, "old_logprobs": old})
        loss_s, grads_s = loss_and_grads(actor, samples, {"advantages": adv})  # no old_logprobs
    finally:
        actor.close()
    assert loss_r == loss_s
    assert set(grads_r) == set(grads_s) and all(torch.equal(grads_r[k], grads_s[k]) for k in grads_r)
    assert any(g.abs().sum() > 0 for g in grads_r.values())
