"""Issue 10: with ``updates_per_batch > 1`` only the mini-batches after the first are replayed.

Oracle: the same updates with the first mini-batch replayed too (each mini-batch replayed on its own,
before any update). The shortcut must give bitwise equal metrics, gradients and weights after every
update, and the trainer must call ``actor.logprobs`` with exactly the later mini-batches' samples.
"""

from __future__ import annotations

import math

import torch

from unirl.actor.torch_actor import TorchActor
from unirl.algorithms.advantages import grpo
from unirl.config import RunConfig
from unirl.contracts import StepInfo
from unirl.models.qwen3 import Qwen3Adapter
from unirl.samples import Sample, chunks
from unirl.testing import default_runtime
from unirl.trainer.loop import Components, ScoredBatch, train_on_batch
from unirl.trainer.replay import replay_later, replay_scope

VOCAB = 64
LENGTHS = [(3, 5), (1, 1), (6, 9), (2, 7), (4, 3), (5, 0), (2, 11), (3, 6)]


def tiny_model(seed: int = 0):
    from transformers import Qwen3ForCausalLM

    cfg = Qwen3Adapter().hf_config(RunConfig(), vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).float()


def samples_of(lengths, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(lengths):
        mask = [1] * r
        if r > 3:
            mask[2] = 0
        out.append(Sample(id=f"p{i // 2}/{i % 2}", prompt_ids=torch.randint(2, VOCAB, (p,), generator=g).tolist(),
                          response_ids=torch.randint(2, VOCAB, (r,), generator=g).tolist(), loss_mask=mask,
                          rollout_logprobs=[-1.0] * r, reward=float(i % 3 == 0)))
    return out


def config_of(**alg) -> RunConfig:
    return RunConfig.model_validate({"actor": {"lr": 1e-3, "micro_batch_size": 2},
                                     "algorithm": {"clip_high": 0.28, "updates_per_batch": 3, **alg}})


def test_replay_scope():
    assert replay_scope(config_of(updates_per_batch=1)) == "none"
    assert replay_scope(config_of()) == "later"
    assert replay_scope(config_of(kl_coef=0.1, kl_form="reward")) == "all"
    assert replay_scope(config_of(modifiers=["rollout_correction"])) == "all"
    assert replay_scope(config_of(old_logp_source="rollout")) == "none"


def _run(skip_first: bool):
    """Three updates over disjoint mini-batches; pi_old of every mini-batch taken before the first."""
    config = config_of()
    actor = TorchActor(config=config, runtime=default_runtime(config), adapter=Qwen3Adapter(), model=tiny_model())
    samples = samples_of(LENGTHS)
    g = torch.Generator().manual_seed(1)
    adv = [torch.randn(len(s.response_ids), generator=g) for s in samples]
    updates = list(chunks([5, 2, 7, 0, 3, 6, 1, 4], 3))
    calls: list[list[str]] = []
    real_logprobs = actor.logprobs
    actor.logprobs = lambda ss: calls.append([s.id for s in ss]) or real_logprobs(ss)
    if skip_first:
        old = replay_later(actor, samples, updates)
    else:  # the oracle: every mini-batch replayed on its own, the first one too
        old = [None] * len(samples)
        for idx in updates:
            for i, lp in zip(idx, actor.logprobs([samples[i] for i in idx]), strict=True):
                old[i] = lp
    grads: list[torch.Tensor] = []
    orig = actor._clip_and_step

    def capture(opt, params):
        grads.extend(p.grad.detach().clone() for p in params)
        return orig(opt, params)

    actor._clip_and_step = capture
    metrics = []
    for u, idx in enumerate(updates):
        batch = {"advantages": [adv[i].clone() for i in idx],
                 "rollout_logprobs": [torch.tensor(samples[i].rollout_logprobs) for i in idx]}
        if old[idx[0]] is not None:
            batch["old_logprobs"] = [old[i] for i in idx]
        metrics.append(actor.train_step([samples[i] for i in idx], batch, StepInfo(update=u)))
    return metrics, grads, [p.detach().clone() for p in actor.model.parameters()], calls, old


def test_replay_later_is_bitwise_the_full_replay():
    m_ref, g_ref, w_ref, calls_ref, old_ref = _run(skip_first=False)
    m_new, g_new, w_new, calls_new, old_new = _run(skip_first=True)
    assert len(calls_ref) == 3 and calls_new == calls_ref[1:]  # the first mini-batch is not replayed
    assert all(old_new[i] is None for i in (5, 2, 7))
    assert all(torch.equal(old_new[i], old_ref[i]) for i in (0, 3, 6, 1, 4))
    for a, b in zip(m_ref, m_new, strict=True):  # every metric of every update, bit for bit
        assert {k: v for k, v in a.items()} == {k: v for k, v in b.items() if k != "rollout_replay_max_diff"
                                                and not k.startswith("mismatch/_")}
    assert "rollout_replay_max_diff" in m_new[0]  # the forward stands in for the replay's diagnostic
    assert m_new[0]["mismatch/_tokens"] > 0  # and for its mismatch sums (unirl.mismatch)
    assert m_ref[0]["clip_frac"] == 0.0 and m_ref[2]["approx_kl"] > 0  # later updates really are off-policy
    assert len(g_ref) == len(g_new) and all(torch.equal(a, b) for a, b in zip(g_ref, g_new, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(w_ref, w_new, strict=True))


def test_trainer_replays_only_later_minibatches():
    """train_on_batch wiring: logprobs sees each later mini-batch once, the first update has no
    old_logprobs, and the engine-vs-trainer diagnostic covers every sample."""
    config = config_of()
    actor = TorchActor(config=config, runtime=default_runtime(config), adapter=Qwen3Adapter(), model=tiny_model())
    samples = samples_of(LENGTHS)
    replayed, steps = [], []
    real_logprobs, real_step = actor.logprobs, actor.train_step
    actor.logprobs = lambda ss: replayed.append({s.id for s in ss}) or real_logprobs(ss)
    actor.train_step = lambda ss, b, info: steps.append(({s.id for s in ss}, "old_logprobs" in b)) or real_step(ss, b, info)
    c = Components(adapter=Qwen3Adapter(), tokenizer=None, runtime=actor.runtime, actor=actor, engine=None,
                   sync=None, estimator=grpo, reward_fn=None, modifiers=[])
    metrics = train_on_batch(0, ScoredBatch(samples, task_reward=0.0, failed=0, rollout_tokens=0), c, config)
    assert [has_old for _, has_old in steps] == [False, True, True]
    assert replayed == [ids for ids, _ in steps[1:]]
    assert math.isfinite(metrics["rollout_replay_max_diff"]) and metrics["rollout_replay_max_diff"] > 0
