"""The correction through the real actor and trainer: micro-batch parity (torch actor), the disabled
path bit-identical to a run without the plugin, and frozen anchors over ``updates_per_batch: 2`` on
a perturbed embedded engine (a real rollout/trainer mismatch)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import rc_reference as ref
import torch
from rc_support import perturb_engine, ragged_samples, synthetic_batch

from unirl.actor.torch_actor import TorchActor, step_denominators
from unirl.api import Qwen3Adapter, RunConfig, StepInfo, default_runtime, load_config, load_kernel, train
from unirl_rollout_correction.correction import rollout_correction

ROOT = Path(__file__).resolve().parents[3]
BUILD = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
TINY = ["trainer.steps=2", "trainer.prompts_per_step=4", "trainer.eval_every=0", "trainer.progress=false",
        "trainer.plot=false", "data.arith.n_train=16", "data.arith.n_eval=2", "rollout.n=2",
        "rollout.max_new_tokens=4", "trainer.eval_k=1", "sft.steps=0", "trainer.save_every=0",
        "model.build={hidden_size: 64, intermediate_size: 128}"]
#: step metrics that depend only on the numbers (not on wall time)
NUMERIC = ("reward", "loss", "pg_loss", "grad_norm", "clip_frac", "approx_kl", "ratio_max", "entropy")


def tiny(tmp_path, *extra):
    return load_config(ROOT / "recipes" / "arith-tiny.yaml",
                       [*TINY, f"run.output_dir={tmp_path}", "run.name=t", *extra])


# ---------------------------------------------------------------------- micro-batch parity


@pytest.fixture(scope="module")
def actor():
    config = RunConfig.model_validate({"model": {"build": BUILD}, "actor": {"micro_batch_size": 8},
                                       "rollout": {"max_new_tokens": 8}})
    return TorchActor(config=config, runtime=default_runtime(config), adapter=Qwen3Adapter())


def grads_with_micro_batches(actor, samples, batch, size, agg):
    config = actor.config.model_copy(deep=True)
    config.algorithm.loss_agg = agg
    config.algorithm.clip_low, config.algorithm.clip_high = 0.1, 0.3
    total_tokens, total_seqs = step_denominators(samples)
    actor.optimizer.zero_grad(set_to_none=True)
    parts = actor._accumulate(actor._micro_batches(samples, batch, size=size), StepInfo(),
                              total_tokens=total_tokens, total_seqs=total_seqs, config=config)
    grads = {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
    actor.optimizer.zero_grad(set_to_none=True)
    return sum(p["loss"] for p in parts), grads


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("mode", ["token_tis", "seq_mask"])
def test_micro_batch_gradient_parity(actor, mode, agg):
    samples = ragged_samples()
    old = actor.logprobs(samples)
    syn = synthetic_batch(samples)
    roll = [torch.minimum(o + (r - s), torch.zeros_like(o)).float()
            for o, r, s in zip(old, syn["rollout_logprobs"], syn["old_logprobs"], strict=True)]
    batch = {"advantages": [a.float() for a in syn["advantages"]], "old_logprobs": old, "rollout_logprobs": roll}
    config = RunConfig.model_validate({"algorithm": {"modifiers": ["rollout_correction"]},
                                       "plugins": {"rollout_correction": {"mode": mode, "threshold": 1.5}}})
    rollout_correction(samples, batch, config)
    assert any(float(w.min()) < 1 for w in batch["token_weights"] if len(w))
    loss1, g1 = grads_with_micro_batches(actor, samples, batch, 8, agg)
    for k in (1, 3):
        lossk, gk = grads_with_micro_batches(actor, samples, batch, k, agg)
        assert abs(lossk - loss1) < 1e-6  # fp32 forwards of differently packed micro-batches
        assert max(float((gk[n] - g1[n]).abs().max()) for n in g1) < 1e-6


# -------------------------------------------------------------- disabled path, end to end


@pytest.mark.slow
def test_mode_none_run_is_bit_identical_to_a_run_without_the_plugin(tmp_path, monkeypatch):
    with_plugin = train(tiny(tmp_path / "a", "algorithm.modifiers=[rollout_correction]",
                             "plugins.rollout_correction={mode: none}"), load_kernel())
    monkeypatch.setenv("UNIRL_PLUGINS", "vllm")  # core + an unrelated plugin: rollout_correction is absent
    kernel = load_kernel()
    assert "rollout_correction" not in kernel.registries["loss_modifiers"]
    without = train(tiny(tmp_path / "b"), kernel)
    for got, want in zip(with_plugin.history[1:], without.history[1:], strict=True):
        assert {k: got[k] for k in NUMERIC} == {k: want[k] for k in NUMERIC}  # bit for bit
        assert got["rc/active_tokens"] > 0 and "rc/active_tokens" not in want  # diagnostics only


# ------------------------------------------------ frozen anchors, perturbed engine, 2 updates


@pytest.mark.slow
def test_weights_are_computed_once_per_batch_from_pi_old_at_batch_start(tmp_path, monkeypatch):
    kernel = load_kernel()
    perturb_engine(kernel, "inprocess", sigma=0.2)
    seen: dict[str, list] = {"replay": [], "updates": []}
    real_logprobs, real_train_step = TorchActor.logprobs, TorchActor.train_step

    def logprobs(self, samples):
        out = real_logprobs(self, samples)
        seen["replay"].append({s.id: t.clone() for s, t in zip(samples, out, strict=True)})
        return out

    def train_step(self, samples, batch, info=StepInfo()):
        now = self._replay(self.model, samples, phase="replay")  # the policy as it is at this update
        seen["updates"].append((info, [s.id for s in samples], [s.loss_mask for s in samples], now,
                                {k: [t.clone() for t in v] for k, v in batch.items()}))
        return real_train_step(self, samples, batch, info)

    monkeypatch.setattr(TorchActor, "logprobs", logprobs)
    monkeypatch.setattr(TorchActor, "train_step", train_step)
    config = tiny(tmp_path, "algorithm.updates_per_batch=2", "algorithm.modifiers=[rollout_correction]",
                  "plugins.rollout_correction={mode: token_tis, threshold: 1.2}")
    result = train(config, kernel)
    steps = result.history[1:]
    assert len(steps) == 2 and len(seen["updates"]) == 4
    for h in steps:
        assert all(math.isfinite(h[k]) for k in NUMERIC)
        assert h["rc/logp_diff_abs_max"] > 1e-3 and h["rc/ess_frac_global"] < 1  # a real mismatch
    moved = 0.0
    for info, ids, masks, now, batch in seen["updates"]:
        start = seen["replay"][info.rl_step]
        old = [start[i] for i in ids]
        for o, b in zip(old, batch["old_logprobs"], strict=True):
            assert torch.equal(o, b)  # pi_old: the replay at the batch start
        want = ref.weights([o.tolist() for o in old], [r.tolist() for r in batch["rollout_logprobs"]], masks,
                           mode="token_tis", threshold=1.2)
        for w, got in zip(want, batch["token_weights"], strict=True):
            assert [g for g, x in zip(got.tolist(), w, strict=True) if x is not None] == \
                pytest.approx([x for x in w if x is not None], rel=1e-6)
        if info.update == 1:  # the policy moved since the batch start; the anchors did not
            moved = max(moved, max(float((n - o).abs().max()) for n, o in zip(now, old, strict=True) if len(o)))
    assert moved > 1e-4
