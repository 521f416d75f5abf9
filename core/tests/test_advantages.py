"""Advantage estimators against hand-computed numbers and an independent plain-Python GAE."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.algorithms.advantages import AdvantageResult, dr_grpo, gae, grpo, rloo
from unirl.config import AlgorithmSection
from unirl.kernel.errors import ConfigError
from unirl.samples import Sample, shuffle

ALG = AlgorithmSection()
NAN = math.nan


def make(gid: str, rewards: list[float], lens: list[int] | None = None, *, failed: tuple[int, ...] = ()):
    out = []
    for i, r in enumerate(rewards):
        n = lens[i] if lens else 3
        s = Sample(id=f"{gid}/{i}", prompt_ids=[1, 2], response_ids=list(range(n)), loss_mask=[1] * n,
                   rollout_logprobs=[0.0] * n, versions=[0] * n, status="ok", reward=r)
        if i in failed:
            s.status = "failed"
        out.append(s)
    return out


def scalars(res: AdvantageResult, samples: list[Sample]) -> dict[str, float]:
    """One value per sample, after checking it is constant over the sample's tokens."""
    out = {}
    for s, a in zip(samples, res.advantages, strict=True):
        assert a.dtype == torch.float32 and a.shape == (len(s.response_ids),)
        if a.numel():
            assert torch.all(a == a[0]), f"{s.id}: outcome advantage not constant per token"
        out[s.id] = float(a[0]) if a.numel() else 0.0
    return out


def approx(d: dict[str, float], expected: dict[str, float], tol: float = 1e-5) -> None:
    assert d.keys() == expected.keys()
    for k, v in expected.items():
        assert d[k] == pytest.approx(v, abs=tol), (k, d[k], v)


# ----------------------------------------------------------------------------- grpo
def test_grpo_by_hand_unbiased_default():
    # group p0: r = [1,0,0,0], mean 0.25, unbiased std sqrt(0.75/3) = 0.5 -> [1.5, -0.5, -0.5, -0.5]
    # group p1: r = [2,4], mean 3, unbiased std sqrt(2) -> [-1/sqrt2, 1/sqrt2]
    samples = make("p0", [1, 0, 0, 0], lens=[2, 5, 1, 3]) + make("p1", [2, 4])
    res = grpo(samples, options={}, algorithm=ALG)
    assert res.returns is None
    approx(scalars(res, samples), {"p0/0": 1.5, "p0/1": -0.5, "p0/2": -0.5, "p0/3": -0.5,
                                   "p1/0": -0.70710678, "p1/1": 0.70710678})
    assert res.metrics["zero_std_group_frac"] == 0.0


def test_grpo_biased_std_and_eps():
    # biased std of [1,0,0,0] = sqrt(0.75/4) -> [sqrt3, -1/sqrt3, ...]
    samples = make("p0", [1, 0, 0, 0])
    res = grpo(samples, options={"std": "biased"}, algorithm=ALG)
    approx(scalars(res, samples), {"p0/0": 1.7320508, "p0/1": -0.5773503, "p0/2": -0.5773503,
                                   "p0/3": -0.5773503})
    # eps is added to the std: std 0.5, eps 0.5 -> 0.75 / 1.0
    res = grpo(samples, options={"eps": 0.5}, algorithm=ALG)
    assert scalars(res, samples)["p0/0"] == pytest.approx(0.75, abs=1e-6)


def test_grpo_batch_scope():
    # group means, batch std: std([1,0,0,0,2,4], unbiased) = sqrt(77/30) = 1.6020820
    samples = make("p0", [1, 0, 0, 0]) + make("p1", [2, 4])
    res = grpo(samples, options={"scope": "batch"}, algorithm=ALG)
    approx(scalars(res, samples), {"p0/0": 0.4681408, "p0/1": -0.1560469, "p0/2": -0.1560469,
                                   "p0/3": -0.1560469, "p1/0": -0.6241878, "p1/1": 0.6241878})


def test_grpo_nan_rewards_excluded_and_zero():
    # p0: valid [1, 0] -> mean 0.5, unbiased std 1/sqrt2 -> +-0.7071; the failed one gets 0
    samples = make("p0", [1, NAN, 0], lens=[2, 4, 3])
    res = grpo(samples, options={}, algorithm=ALG)
    approx(scalars(res, samples), {"p0/0": 0.70710678, "p0/1": 0.0, "p0/2": -0.70710678})
    assert res.advantages[1].shape == (4,) and torch.all(res.advantages[1] == 0)
    assert res.metrics["failed_frac"] == pytest.approx(1 / 3)


def test_status_failed_counts_as_failed_even_with_a_reward():
    samples = make("p0", [1, 5, 0], failed=(1,))
    res = grpo(samples, options={}, algorithm=ALG)
    approx(scalars(res, samples), {"p0/0": 0.70710678, "p0/1": 0.0, "p0/2": -0.70710678})


def test_all_failed_group_and_singletons_are_zero():
    samples = make("p0", [NAN, NAN]) + make("p1", [3.0]) + make("p2", [1.0, NAN]) + make("p3", [1, 1])
    for est in (grpo, dr_grpo, rloo):
        res = est(samples, options={}, algorithm=ALG)
        d = scalars(res, samples)
        assert all(v == 0.0 for v in d.values()), (est.__name__, d)
        assert all(torch.isfinite(a).all() for a in res.advantages)
    # p1, p2 (one valid member) and p3 (equal rewards) have zero spread; p0 has no valid member
    assert res.metrics["zero_std_group_frac"] == pytest.approx(1.0)


def test_shuffle_gives_same_advantage_per_id():
    samples = make("a", [1, 0, 0, 1, 1]) + make("b", [0.5, NAN, 2.0]) + make("c", [3, 1, 2, 2])
    for est in (grpo, dr_grpo, rloo):
        base = scalars(est(samples, options={}, algorithm=ALG), samples)
        for seed in range(3):
            sh = shuffle(samples, seed)
            assert [s.id for s in sh] != [s.id for s in samples]
            approx(scalars(est(sh, options={}, algorithm=ALG), sh), base, tol=1e-7)


# ----------------------------------------------------------------------------- dr_grpo / rloo
def test_dr_grpo_by_hand():
    samples = make("p0", [1, 0, 0, 0]) + make("p1", [2, 4]) + make("p2", [1, NAN, 0])
    res = dr_grpo(samples, options={}, algorithm=ALG)
    approx(scalars(res, samples), {"p0/0": 0.75, "p0/1": -0.25, "p0/2": -0.25, "p0/3": -0.25,
                                   "p1/0": -1.0, "p1/1": 1.0, "p2/0": 0.5, "p2/1": 0.0, "p2/2": -0.5})


def test_rloo_by_hand():
    # r_i - mean(others): [1,0,0,0] -> [1, -1/3, -1/3, -1/3]; [2,4] -> [-2, 2]; [1,nan,0] -> [1, 0, -1]
    samples = make("p0", [1, 0, 0, 0]) + make("p1", [2, 4]) + make("p2", [1, NAN, 0])
    res = rloo(samples, options={}, algorithm=ALG)
    approx(scalars(res, samples), {"p0/0": 1.0, "p0/1": -1 / 3, "p0/2": -1 / 3, "p0/3": -1 / 3,
                                   "p1/0": -2.0, "p1/1": 2.0, "p2/0": 1.0, "p2/1": 0.0, "p2/2": -1.0})


def test_bad_options_and_rewards_are_errors():
    samples = make("p0", [1, 0])
    with pytest.raises(ConfigError, match="scop"):
        grpo(samples, options={"scop": "batch"}, algorithm=ALG)
    with pytest.raises(ConfigError):
        grpo(samples, options={"scope": "global"}, algorithm=ALG)
    with pytest.raises(ConfigError):
        rloo(samples, options={"eps": 1.0}, algorithm=ALG)
    with pytest.raises(ValueError, match="p0/1"):
        grpo(make("p0", [1, math.inf]), options={}, algorithm=ALG)


# ----------------------------------------------------------------------------- gae
def ref_gae(reward: float, values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """Textbook GAE, one trajectory, terminal reward, plain Python."""
    T = len(values)
    adv = [0.0] * T
    running = 0.0
    for t in reversed(range(T)):
        r_t = reward if t == T - 1 else 0.0
        v_next = values[t + 1] if t + 1 < T else 0.0
        delta = r_t + gamma * v_next - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv, [a + v for a, v in zip(adv, values, strict=True)]


def test_gae_by_hand_two_tokens():
    # V = [0.5, 1.0], r = 2, gamma 0.9, lam 0.5:
    # delta_1 = 2 - 1 = 1 -> A_1 = 1;  delta_0 = 0.9*1.0 - 0.5 = 0.4 -> A_0 = 0.4 + 0.45*1 = 0.85
    alg = AlgorithmSection(gamma=0.9, lam=0.5)
    samples = make("p0", [2.0], lens=[2])
    res = gae(samples, options={"whiten": False}, algorithm=alg, values=[torch.tensor([0.5, 1.0])])
    assert torch.allclose(res.advantages[0], torch.tensor([0.85, 1.0]))
    assert torch.allclose(res.returns[0], torch.tensor([1.35, 2.0]))


def test_gae_matches_plain_python_various_lengths():
    g = torch.Generator().manual_seed(0)
    alg = AlgorithmSection(gamma=0.97, lam=0.9)
    lens = [1, 4, 7, 2, 0, 5]
    rewards = [1.0, -0.5, 2.0, 0.0, 1.0, 3.0]
    samples = [make(f"p{i}", [r], lens=[n])[0] for i, (r, n) in enumerate(zip(rewards, lens, strict=True))]
    values = [torch.randn(n, generator=g) for n in lens]
    res = gae(samples, options={"whiten": False}, algorithm=alg, values=values)
    for s, v, a, ret in zip(samples, values, res.advantages, res.returns, strict=True):
        ea, er = ref_gae(s.reward, v.tolist(), alg.gamma, alg.lam)
        assert a.dtype == torch.float32 and a.shape == (len(s.response_ids),)
        assert torch.allclose(a, torch.tensor(ea), atol=1e-6), s.id
        assert torch.allclose(ret, torch.tensor(er), atol=1e-6), s.id


def test_gae_no_leakage_between_trajectories():
    alg = AlgorithmSection(gamma=1.0, lam=0.95)
    samples = make("p0", [1.0, 0.0, 2.0], lens=[3, 5, 2])
    values = [torch.tensor([0.1, 0.2, 0.3]), torch.tensor([1.0, -1, 2, 0.5, 0.0]), torch.tensor([0.7, 0.9])]
    base = gae(samples, options={"whiten": False}, algorithm=alg, values=values)
    changed = [values[0], values[1] * 10 + 3, values[2]]
    other = gae(samples, options={"whiten": False}, algorithm=alg, values=changed)
    assert torch.equal(base.advantages[0], other.advantages[0])
    assert torch.equal(base.advantages[2], other.advantages[2])
    assert not torch.allclose(base.advantages[1], other.advantages[1])
    # changing a reward does not leak either
    samples[0].reward = 5.0
    third = gae(samples, options={"whiten": False}, algorithm=alg, values=values)
    assert torch.equal(base.advantages[1], third.advantages[1])
    assert torch.equal(base.advantages[2], third.advantages[2])


def test_gae_whitening_over_valid_tokens_only():
    alg = AlgorithmSection(gamma=0.99, lam=0.95)
    samples = make("p0", [1.0, 0.0, 3.0], lens=[3, 4, 2])
    samples[1].loss_mask = [1, 0, 0, 1]  # two tool-observation tokens
    samples[2].status = "failed"
    samples[2].reward = NAN
    values = [torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.5, 0.4, 0.3, 0.2]), torch.tensor([9.0, 9.0])]
    res = gae(samples, options={}, algorithm=alg, values=values)

    raw = [ref_gae(s.reward, v.tolist(), alg.gamma, alg.lam)[0] for s, v in zip(samples[:2], values, strict=False)]
    valid = raw[0] + [raw[1][0], raw[1][3]]
    mean = sum(valid) / len(valid)
    var = sum((x - mean) ** 2 for x in valid) / (len(valid) - 1)
    w = [(x - mean) / math.sqrt(var + 1e-8) for x in valid]
    assert torch.allclose(res.advantages[0], torch.tensor(w[:3]), atol=1e-6)
    assert torch.allclose(res.advantages[1], torch.tensor([w[3], 0.0, 0.0, w[4]]), atol=1e-6)
    assert torch.equal(res.advantages[2], torch.zeros(2))  # failed: zero, and not in the stats
    # returns are the unwhitened A + V (observation tokens included); failed -> values
    assert torch.allclose(res.returns[1], torch.tensor(ref_gae(0.0, values[1].tolist(), 0.99, 0.95)[1]), atol=1e-6)
    assert torch.allclose(res.returns[2], values[2])
    valid_flat = torch.cat([res.advantages[0], res.advantages[1][[0, 3]]])
    assert res.metrics["adv_mean"] == pytest.approx(0.0, abs=1e-6)
    assert float(valid_flat.std()) == pytest.approx(1.0, abs=1e-4)


def test_gae_recursion_runs_through_masked_tokens():
    # observation tokens are ordinary steps: the advantage of token 0 sees the reward across them
    alg = AlgorithmSection(gamma=1.0, lam=1.0)
    samples = make("p0", [1.0], lens=[4])
    samples[0].loss_mask = [1, 0, 0, 1]
    res = gae(samples, options={"whiten": False}, algorithm=alg, values=[torch.zeros(4)])
    assert torch.allclose(res.advantages[0], torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert torch.allclose(res.returns[0], torch.ones(4))


def test_gae_requires_values():
    samples = make("p0", [1.0], lens=[2])
    with pytest.raises(ValueError, match="value"):
        gae(samples, options={}, algorithm=ALG)
    with pytest.raises(ValueError, match="values"):
        gae(samples, options={}, algorithm=ALG, values=[torch.zeros(3)])
