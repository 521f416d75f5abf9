"""Oracle tests for the estimators added with the algorithm menu: GRPO with a leave-one-out baseline,
REINFORCE++ and REINFORCE++-baseline. References are plain Python from the papers' formulas."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from unirl.algorithms.advantages import grpo, reinforce_pp, reinforce_pp_baseline, rloo
from unirl.config import AlgorithmSection
from unirl.contracts import traits_of
from unirl.samples import Sample

ALG = AlgorithmSection()


def make(gid, rewards, lens, *, failed=(), masks=None):
    out = []
    for i, (r, n) in enumerate(zip(rewards, lens, strict=True)):
        s = Sample(id=f"{gid}/{i}", prompt_ids=[1], response_ids=list(range(n)),
                   loss_mask=(masks[i] if masks else [1] * n), rollout_logprobs=[0.0] * n, versions=[0] * n,
                   status="ok", reward=r)
        if i in failed:
            s.status = "failed"
        out.append(s)
    return out


def batch():
    # ragged: an empty response, a length-1 response, a fully masked one, a failed one
    return (make("a", [1.0, 0.0, 0.0, 1.0], [3, 0, 1, 4])
            + make("b", [2.0, 5.0, 3.0], [2, 2, 3], failed=(2,))
            + make("c", [1.0, 0.0], [2, 3], masks=[[0, 0], [1, 1, 1]]))


def test_grpo_leave_one_out_baseline():
    samples = batch()
    res = grpo(samples, options={"baseline": "loo"}, algorithm=ALG)
    expected = {}
    for gid in "abc":
        members = [s for s in samples if s.group_id == gid and not s.failed]
        r = [s.reward for s in members]
        sd = statistics.stdev(r)
        for i, s in enumerate(members):
            others = r[:i] + r[i + 1:]
            expected[s.id] = (r[i] - sum(others) / len(others)) / (sd + 1e-6)
    for s, a in zip(samples, res.advantages, strict=True):
        assert a.shape == (len(s.response_ids),)
        want = 0.0 if s.failed else expected[s.id]
        assert torch.allclose(a, torch.full_like(a, want), atol=1e-5), (s.id, a, want)
    # the numerator is rloo's: grpo(loo) * std == rloo
    r = rloo(samples, options={}, algorithm=ALG)
    a0 = float(res.advantages[0][0]) * (statistics.stdev([1.0, 0.0, 0.0, 1.0]) + 1e-6)
    assert a0 == pytest.approx(float(r.advantages[0][0]), abs=1e-5)


def whiten_reference(samples, scalar):
    """Token-level whitening over valid tokens (loss_mask 1, not failed): (x - mean) / sqrt(var + 1e-8)."""
    toks = []
    for s in samples:
        if s.failed:
            continue
        toks += [scalar[s.id]] * sum(s.loss_mask)
    mean = sum(toks) / len(toks)
    var = sum((x - mean) ** 2 for x in toks) / (len(toks) - 1)
    out = {}
    for s in samples:
        out[s.id] = [0.0 if (s.failed or not m) else (scalar[s.id] - mean) / math.sqrt(var + 1e-8) for m in s.loss_mask]
    return out


def check(res, samples, expected):
    for s, a in zip(samples, res.advantages, strict=True):
        assert a.dtype == torch.float32 and a.shape == (len(s.response_ids),)
        assert torch.allclose(a.double(), torch.tensor(expected[s.id], dtype=torch.float64), atol=1e-5), s.id


def test_reinforce_pp_is_the_reward_whitened_over_the_batch():
    samples = batch()
    res = reinforce_pp(samples, options={}, algorithm=ALG)
    check(res, samples, whiten_reference(samples, {s.id: s.reward for s in samples}))
    t = traits_of(reinforce_pp)
    assert not t.needs_groups and t.min_n == 1
    single = make("x", [1.0], [2]) + make("y", [0.0], [3])  # works with n = 1
    res1 = reinforce_pp(single, options={}, algorithm=ALG)
    assert float(res1.advantages[0][0]) > 0 > float(res1.advantages[1][0])


def test_reinforce_pp_baseline_subtracts_the_group_mean_first():
    samples = batch()
    centred = {}
    for gid in "abc":
        live = [s for s in samples if s.group_id == gid and not s.failed]
        mean = sum(s.reward for s in live) / len(live)
        centred.update({s.id: s.reward - mean for s in live})
    centred.update({s.id: 0.0 for s in samples if s.failed})
    res = reinforce_pp_baseline(samples, options={}, algorithm=ALG)
    check(res, samples, whiten_reference(samples, centred))
    assert traits_of(reinforce_pp_baseline).needs_groups
    assert "zero_std_group_frac" in res.metrics
