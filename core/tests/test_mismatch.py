"""The train-inference mismatch diagnostics (unirl.mismatch, docs/mismatch.md), against known answers.

* the statistics against values computed here by hand from their formulas;
* the actor's held versions: a replay at a held version is bitwise the replay those weights gave, and the
  live weights are back bit for bit afterwards;
* the decomposition on the real embedded engine and actor: with the parity provider the numerics term is
  exactly 0 and the staleness term is exactly the total; perturbing the behaviour log-probs moves the
  numerics term and leaves the staleness term bit for bit where it was;
* the alarm's rules, its modes, and the profile it names.

The trainer-loop runs (sync, a perturbed engine, async with max_staleness 2) are in test_mismatch_runs.py.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from unirl.config import load_config
from unirl.kernel import load_kernel
from unirl.kernel.errors import ConfigError
from unirl.mismatch.alarm import (
    MismatchAlarm,
    MismatchAlarmError,
    MismatchWarning,
    likely_causes,
    parity_profile,
)
from unirl.mismatch.monitor import MismatchMonitor
from unirl.mismatch.stats import MismatchSums, log_ratio_sums
from unirl.testing import sample_stale_batch
from unirl.trainer.components import build_components

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["sft.steps=0", "trainer.steps=2", "trainer.prompts_per_step=2", "trainer.eval_every=0",
         "trainer.progress=false", "trainer.plot=false", "data.arith.n_train=64", "data.arith.n_eval=8",
         "rollout.n=4", "rollout.max_new_tokens=6", "model.build={hidden_size: 64, intermediate_size: 128}",
         "actor.lr=3e-3", "algorithm.updates_per_batch=1"]
#: the parity provider (unirl-parity-vllm, installed with the dev stack): the engine's decode and the actor's
#: replay run the same batch-invariant ops, bit for bit (as core/tests/test_async_trainer.py uses it)
PARITY = ["plugins.parity={enabled: true, dtype: float32, weight_sync: inprocess, logprobs_mode: raw_logprobs, "
          "topology: {actor: torch, actor_ranks: 1, engine: torch}}"]


def small_config(tmp_path, *extra):
    return load_config(ROOT / "recipes" / "arith-tiny.yaml", [*SMALL, f"run.output_dir={tmp_path}", *extra])


# ------------------------------------------------------------------------------------------ statistics


def test_statistics_match_their_formulas():
    ref = torch.tensor([-1.0, -2.0, -0.5, -3.0, -0.25])
    r = [0.0, 5e-4, -2e-3, 0.3, 7.0]  # the last is masked out
    trainer = ref + torch.tensor(r)
    mask = torch.tensor([1, 1, 1, 1, 0])
    s = log_ratio_sums(ref, trainer, mask)
    kept = [(trainer[i].double() - ref[i].double()).item() for i in range(4)]  # r as float32 arithmetic left it
    assert s.tokens == 4
    assert s.mean("abs_mean") == pytest.approx(sum(abs(x) for x in kept) / 4, rel=1e-12)
    assert s.mean("k3") == pytest.approx(sum(math.exp(x) - 1 - x for x in kept) / 4, rel=1e-9)
    assert s.mean("frac_gt_1e-3") == 0.5 and s.mean("frac_gt_1e-1") == 0.25  # |r| 2e-3 and 0.3; 0.3
    # k3 is KL(ref || trainer)'s estimator: exp(r) - 1 - r >= 0, and 0 exactly where the two agree
    assert log_ratio_sums(ref, ref.clone()) == MismatchSums(tokens=5)
    # sums add across pieces (micro-batches, ranks, versions) to the sums of the whole
    a, b = log_ratio_sums(ref[:2], trainer[:2]), log_ratio_sums(ref[2:4], trainer[2:4])
    assert (a + b).tokens == 4 and (a + b).abs_sum == pytest.approx(s.abs_sum, rel=1e-12)
    metrics = s.metrics("numerics")
    assert set(metrics) == {"mismatch/numerics_abs_mean", "mismatch/numerics_k3", "mismatch/numerics_frac_gt_1e-3",
                            "mismatch/numerics_frac_gt_1e-1"}
    private = {"loss": 1.0, **s.as_tensor_metrics()}
    assert MismatchSums.pop_from(private) == s and private == {"loss": 1.0}


def test_k3_is_clamped_so_a_wild_token_stays_finite():
    s = log_ratio_sums(torch.tensor([-100.0]), torch.tensor([0.0]))  # r = 100
    assert math.isfinite(s.k3_sum) and s.k3_sum == pytest.approx(math.exp(20) - 1 - 20)


# ------------------------------------------------------------------------------------------ the alarm


def test_alarm_rules_name_what_the_config_shows_and_the_profile_that_removes_it(tmp_path):
    plain = small_config(tmp_path)
    assert likely_causes(plain) == []
    assert parity_profile(plain) == "parity-tiny-embedded"  # read from the profiles' plugins.parity sections
    risky = small_config(tmp_path, "rollout.options={dtype: bfloat16}", "rollout.temperature=0.7",
                         "actor.options={compile: true}")
    causes = likely_causes(risky)
    assert [c.split(":")[0] for c in causes] == [
        "rollout.options.dtype / model.dtype vs actor.options.compute_dtype",
        "rollout.logprobs with temperature / top_k / top_p", "actor.options.compile"]
    assert "bfloat16" in causes[0] and "float32" in causes[0]
    assert parity_profile(risky) == "parity-tiny-bf16-embedded"


def test_alarm_warns_once_errors_or_stays_off(tmp_path):
    warn = MismatchAlarm(small_config(tmp_path))
    assert not warn.check(0, 1e-3)  # the bound itself is not above it
    with pytest.warns(MismatchWarning, match=r"k3 KL is 0.002 at step 2.*parity-tiny-embedded"):
        assert warn.check(1, 2e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn.check(2, 5.0)  # once a run
    with pytest.raises(MismatchAlarmError, match="diagnostics.mismatch_threshold 0.01"):
        MismatchAlarm(small_config(tmp_path, "diagnostics.mismatch_alarm=error",
                                   "diagnostics.mismatch_threshold=0.01")).check(0, 0.5)
    assert not MismatchAlarm(small_config(tmp_path, "diagnostics.mismatch_alarm=off")).check(0, 5.0)


def test_diagnostics_keys_are_bounded(tmp_path):
    with pytest.raises(ConfigError, match="diagnostics.mismatch_every"):
        small_config(tmp_path, "diagnostics.mismatch_every=-1")
    with pytest.raises(ConfigError, match="diagnostics.mismatch_alarm"):
        small_config(tmp_path, "diagnostics.mismatch_alarm=loud")
    with pytest.raises(ConfigError, match="diagnostics.mismatch_threshold"):
        small_config(tmp_path, "diagnostics.mismatch_threshold=.nan")


def test_mismatch_every_defaults_to_10_and_0_turns_it_off(tmp_path):
    """Off keeps no version and measures nothing; the default keeps the window's versions in async mode
    (sync never replays an older version, so it keeps none either way)."""
    default = small_config(tmp_path, "rollout.mode=async")
    assert default.diagnostics.mismatch_every == 10 and MismatchMonitor(default).keeps
    assert not MismatchMonitor(small_config(tmp_path)).keeps  # sync
    off = MismatchMonitor(small_config(tmp_path, "rollout.mode=async", "diagnostics.mismatch_every=0"))
    assert not off.keeps
    assert off.before_update(10, [], {}, actor=None) is None  # returns before it would read the actor


# ------------------------------------------------------------------------------------------ decomposition


def stale_batch(tmp_path, monkeypatch, *extra):
    """A batch sampled at version 1 by the real embedded engine, then an actor two publishes and three
    updates further on: the monitor's measurement of it, the samples, and the components (to close)."""
    monkeypatch.delenv("UNIRL_PARITY_DIR", raising=False)
    config = small_config(tmp_path, "rollout.mode=async", "rollout.max_staleness=2", *extra)
    c = build_components(config, load_kernel())
    monitor, samples = sample_stale_batch(config, c)
    return monitor, samples, c


def measure(monitor, samples, c):
    batch = {"rollout_logprobs": [torch.tensor(s.rollout_logprobs) for s in samples]}
    m = monitor.before_update(0, samples, batch, c.actor)
    return m, monitor.metrics(0, m, None)


@pytest.mark.slow
def test_parity_makes_numerics_exactly_zero_and_staleness_the_total(tmp_path, monkeypatch):
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    monitor, samples, c = stale_batch(tmp_path, monkeypatch, *PARITY)
    try:
        live = c.actor.logprobs(samples)
        at_1 = c.actor.logprobs_at(1, samples)  # the weights that sampled the batch, kept at its publish
        assert all(torch.equal(a, torch.tensor(s.rollout_logprobs)) for a, s in zip(at_1, samples, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(live, c.actor.logprobs(samples), strict=True))  # restored
        m, metrics = measure(monitor, samples, c)
        assert m.numerics.tokens > 0 and m.numerics == MismatchSums.zero(m.numerics.tokens)
        assert m.staleness == m.total and m.staleness.abs_sum > 0 and m.unheld == 0
        assert metrics["mismatch/numerics_k3"] == 0.0 and metrics["mismatch/staleness_k3"] > 0
        # an engine whose log-probs are off (here: the reported ones, shifted): numerics moves, staleness does not
        for i, s in enumerate(samples):
            s.rollout_logprobs = [x - 0.01 * (1 + i % 3) for x in s.rollout_logprobs]
        moved, _ = measure(monitor, samples, c)
        assert moved.numerics.mean("abs_mean") == pytest.approx(0.01 * sum(
            (1 + i % 3) * sum(s.loss_mask) for i, s in enumerate(samples)) / m.numerics.tokens, rel=1e-3)
        assert moved.staleness == m.staleness
    finally:
        c.close()


@pytest.mark.slow
def test_without_parity_numerics_is_small_and_staleness_carries_the_move(tmp_path, monkeypatch):
    monitor, samples, c = stale_batch(tmp_path, monkeypatch)
    try:
        m, metrics = measure(monitor, samples, c)
        assert 0 < metrics["mismatch/numerics_abs_mean"] < 1e-5  # fp32 kernels: last-bit differences only
        assert metrics["mismatch/staleness_abs_mean"] > 1e-3
        assert metrics["mismatch/unheld_tokens"] == 0.0
        monitor.held.discard(1)  # a version no longer held (a resume): its tokens are counted and left out
        gone, metrics = measure(monitor, samples, c)
        assert gone.unheld == m.numerics.tokens and metrics["mismatch/numerics_abs_mean"] == 0.0
        with pytest.raises(Exception, match="weight version 7 is not held"):
            c.actor.logprobs_at(7, samples)
        # an actor that declares it keeps no versions is never asked to: its older tokens count as unheld
        c.actor.keeps_versions = False
        other = MismatchMonitor(monitor.config)
        other.published(4, c.actor)
        assert other.held == set() and 4 not in c.actor._held and other.trained == 4
    finally:
        c.close()
