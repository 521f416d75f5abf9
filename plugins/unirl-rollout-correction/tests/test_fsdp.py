"""2 gloo ranks (unirl-fsdp on Ray, CPU, fp32) against the single-process torch actor: the corrected
global-token gradient is the same when the correction (or the loss mask) zeroes one rank entirely.

The modifier runs once in the driver over the whole step batch, so its weights and its ``rc/``
diagnostics are global by construction; the ranks only multiply their shard's tokens by them, with
the step's global denominators.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("CI", "").lower() != "true":
    pytest.importorskip("ray")
    pytest.importorskip("unirl_fsdp")

import torch  # noqa: E402
from rc_support import ragged_samples, synthetic_batch  # noqa: E402

from unirl.actor.torch_actor import TorchActor, micro_batch_loss, step_denominators  # noqa: E402
from unirl.algorithms.losses import LossSettings, ppo_clip  # noqa: E402
from unirl.api import (  # noqa: E402
    Qwen3Adapter,
    RunConfig,
    build_runtime,
    load_kernel,
)
from unirl_rollout_correction.correction import rollout_correction  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

BUILD = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
TOL = 1e-6


@pytest.fixture(scope="module")
def setup():
    import fsdp_support
    import ray

    from unirl.api import build_actor

    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False,
             log_to_driver=False)
    config = RunConfig.model_validate({
        "model": {"build": BUILD},
        "actor": {"name": "fsdp", "lr": 1e-3, "micro_batch_size": 2, "grad_clip": 1.0,
                  "options": {"world_size": 2, "cpus_per_rank": 0.5, "step_timeout_s": 120,
                              "worker_cls": fsdp_support.WORKER_CLS}},
        "rollout": {"n": 2, "max_new_tokens": 8},
        "algorithm": {"modifiers": ["rollout_correction"], "clip_low": 0.1, "clip_high": 0.3},
        "plugins": {"rollout_correction": {"mode": "seq_mask", "threshold": 2.0}},
    })
    kernel = load_kernel()
    runtime = build_runtime(config, kernel, adapter=Qwen3Adapter())
    torch_actor = TorchActor(config=config, adapter=Qwen3Adapter(), runtime=runtime)
    fsdp = build_actor(config, adapter=Qwen3Adapter(), runtime=runtime)
    try:
        yield config, torch_actor, fsdp
    finally:
        fsdp.close()
        ray.shutdown()


def reference(actor, samples, batch, config):
    total_tokens, total_seqs = step_denominators(samples)
    actor.optimizer.zero_grad(set_to_none=True)
    loss, _, _ = micro_batch_loss(actor.model, samples, batch, config=config, loss_fn=ppo_clip,
                                  total_tokens=total_tokens, total_seqs=total_seqs,
                                  settings=LossSettings.from_algorithm(
                                      config.algorithm, norm_len=config.rollout.max_new_tokens))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
    actor.optimizer.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


@pytest.mark.parametrize("how", ["weights", "loss_mask"])
def test_global_gradient_equals_single_process_with_one_rank_zeroed(setup, how):
    from fsdp_support import loss_and_grads

    config, torch_actor, fsdp = setup
    samples = ragged_samples()
    shards = fsdp._shard(samples)
    off = set(shards[1])
    assert off and set(shards[0])
    old = torch_actor.logprobs(samples)
    syn = synthetic_batch(samples, mismatch=0.05)
    roll = []
    for i, o in enumerate(old):
        if i in off and how == "weights":
            roll.append(o - 1.0)  # every sequence on rank 1 is far outside the seq_mask band -> weight 0
        else:
            roll.append(torch.minimum(o + (syn["rollout_logprobs"][i] - syn["old_logprobs"][i]).float() * 0.2,
                                      torch.zeros_like(o)))
    if how == "loss_mask":
        samples = [s.copy() for s in samples]
        for i in off:
            samples[i].loss_mask = [0] * len(samples[i].response_ids)
    batch = {"advantages": [a.float() for a in syn["advantages"]], "old_logprobs": old, "rollout_logprobs": roll}
    metrics = rollout_correction(samples, batch, config)
    w = batch["token_weights"]
    if how == "weights":
        active = [torch.tensor(samples[i].loss_mask, dtype=torch.bool) for i in range(len(samples))]
        assert all(float(w[i][active[i]].abs().sum()) == 0 for i in off)  # rank 1: every loss token 0
        assert any(float(w[i][active[i]].sum()) > 0 for i in shards[0])
        n_off = sum(1 for i in off if samples[i].response_ids and any(samples[i].loss_mask))
        assert metrics["rc/clipped_seq_frac"] == pytest.approx(n_off / metrics["rc/active_seqs"])
    want_loss, want = reference(torch_actor, samples, batch, config)
    got_loss, got = loss_and_grads(fsdp, samples, batch)
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    print(f"[{how}] loss {got_loss:.6g} |dloss| {abs(got_loss - want_loss):.2e} max|dgrad| {diff:.2e}")
    assert set(got) == set(want)
    assert abs(got_loss - want_loss) < TOL and diff < TOL
    assert max(float(g.abs().max()) for g in want.values()) > 1e-4  # a real, non-zero gradient
