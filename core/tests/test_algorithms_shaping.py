"""DAPO's dynamic sampling and overlong shaping, KL in reward, and the preflight pairing checks."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.algorithms.shaping import (
    apply_kl_in_reward,
    apply_overlong_penalty,
    fill_groups,
    informative,
    overlong_penalty,
)
from unirl.config import load_config
from unirl.kernel import load_kernel
from unirl.preflight import preflight
from unirl.samples import Sample


def group(gid: str, rewards: list[float], n_tokens: int = 3, failed: tuple[int, ...] = ()) -> list[Sample]:
    out = []
    for i, r in enumerate(rewards):
        s = Sample(id=f"{gid}/{i}", prompt_ids=[1], response_ids=[5] * n_tokens, loss_mask=[1] * n_tokens,
                   rollout_logprobs=[0.0] * n_tokens, versions=[0] * n_tokens, status="ok", reward=r)
        if i in failed:
            s.mark_failed("test")
        out.append(s)
    return out


class Rounds:
    """A fake rollout: round k has `groups` prompts, the even ones with all-equal rewards."""

    def __init__(self, groups: int, n: int = 4, mixed_every: int = 2):
        self.groups, self.n, self.mixed_every, self.calls = groups, n, mixed_every, 0

    def __call__(self, k: int) -> list[Sample]:
        assert k == self.calls
        self.calls += 1
        out = []
        for g in range(self.groups):
            gid = f"p{g}@train-0.{k}"
            if g % self.mixed_every == 0:
                out += group(gid, [1.0] * self.n if g % 4 == 0 else [0.0] * self.n)
            else:
                out += group(gid, [1.0] + [0.0] * (self.n - 1))
        return out


def test_informative():
    assert informative(group("a", [1, 0, 0]))
    assert not informative(group("a", [1, 1, 1])) and not informative(group("a", [0, 0]))
    assert not informative(group("a", [1.0, 0.0], failed=(1,)))  # one live member: nothing to compare
    assert not informative(group("a", [1.0]))


def test_dynamic_sampling_refills_the_batch_with_mixed_groups_only():
    draw = Rounds(groups=8)  # half the groups of every round have equal rewards
    res = fill_groups(draw, target=8, max_draws=4)
    ids = {s.group_id for s in res.samples}
    assert len(ids) == 8 and len(res.samples) == 8 * 4  # full size
    groups_ = {}
    for s in res.samples:
        groups_.setdefault(s.group_id, []).append(s)
    assert all(informative(g) for g in groups_.values())
    assert res.draws == 2 == draw.calls  # 4 mixed per round: two rounds fill 8
    assert res.metrics == {"ds_draws": 2.0, "ds_groups_drawn": 16.0, "ds_groups_kept": 8.0, "ds_kept_frac": 0.5,
                           "ds_batch_groups": 8.0}


def test_dynamic_sampling_cuts_to_the_target_in_draw_order():
    res = fill_groups(Rounds(groups=8, mixed_every=100), target=5, max_draws=4)  # all but group 0 mixed
    assert res.draws == 1 and res.metrics["ds_groups_kept"] == 7.0 and res.metrics["ds_batch_groups"] == 5.0
    assert [s.group_id for s in res.samples[::4]] == [f"p{g}@train-0.0" for g in range(1, 6)]


def test_dynamic_sampling_respects_the_draw_bound_and_reports_it():
    draw = Rounds(groups=8, mixed_every=2)
    res = fill_groups(draw, target=20, max_draws=3)  # 4 mixed per round: 3 rounds give 12 < 20
    assert draw.calls == 3 and res.draws == 3
    assert res.metrics["ds_draws"] == 3.0 and res.metrics["ds_batch_groups"] == 12.0
    assert len(res.samples) == 12 * 4
    # nothing informative at all: the first round is kept (zero advantages), the bound still holds
    flat = Rounds(groups=4, mixed_every=1)
    res = fill_groups(flat, target=4, max_draws=2)
    assert flat.calls == 2 and res.metrics["ds_groups_kept"] == 0.0 and res.metrics["ds_batch_groups"] == 4.0
    assert {s.group_id for s in res.samples} == {f"p{g}@train-0.0" for g in range(4)}
    with pytest.raises(ValueError):
        fill_groups(flat, target=4, max_draws=0)


def test_dynamic_sampling_judges_a_launch_at_the_estimators_group_layer():
    """Under ``group_layer: fork`` the estimator compares the branches of one fork point, so a launch
    whose forks each agree within themselves teaches nothing, even when its forks disagree with each
    other (root-level variance): fork-layer dynamic sampling drops it, root-layer keeps it. Under
    ``turn`` a turn's group is the members that reached it."""
    from unirl.algorithms.shaping import informative_at, layer_groups

    def launch(gid: str, fork_rewards: list[list[float]]) -> list[Sample]:
        out = []
        for f, rewards in enumerate(fork_rewards):
            parent = Sample(id=f"{gid}/{f}", prompt_ids=[1], seed=f)
            parent.append_model_turn([5], [0.0], 0, "stop")
            parent.append_observation([6])
            for b, r in enumerate(rewards):
                s = parent.fork(b)
                s.append_model_turn([7], [0.0], 0, "stop")
                s.reward, s.status = r, "ok"
                out.append(s)
        return out

    agree_within = launch("p0@t", [[1.0, 1.0], [0.0, 0.0]])  # forks differ, branches of each agree
    mixed_fork = launch("p1@t", [[1.0, 0.0], [0.0, 0.0]])
    assert [len(g) for g in layer_groups(agree_within, "fork")] == [2, 2]
    assert informative_at(agree_within, "root") and not informative_at(agree_within, "fork")
    assert informative_at(mixed_fork, "fork")
    res = fill_groups(lambda k: agree_within + mixed_fork, target=2, max_draws=1, layer="fork")
    assert [s.id for s in res.samples] == [s.id for s in mixed_fork] and res.metrics["ds_groups_kept"] == 1
    res = fill_groups(lambda k: agree_within + mixed_fork, target=2, max_draws=1, layer="root")
    assert res.metrics["ds_groups_kept"] == 2
    # turn layer: one member ended after its first turn; turn 1's group is the other two, which agree
    short = Sample(id="p2@t/0", prompt_ids=[1], seed=0)
    short.append_model_turn([5], [0.0], 0, "stop")
    short.reward, short.status = 1.0, "ok"
    long = []
    for i in (1, 2):
        s = Sample(id=f"p2@t/{i}", prompt_ids=[1], seed=i)
        s.append_model_turn([5], [0.0], 0, "stop")
        s.append_observation([6])
        s.append_model_turn([7], [0.0], 0, "stop")
        s.reward, s.status = 0.0, "ok"
        long.append(s)
    assert [len(g) for g in layer_groups([short, *long], "turn")] == [3, 2]
    assert informative_at([short, *long], "turn")  # turn 0: 1 vs 0, 0
    assert not informative_at(long, "turn")


def test_overlong_penalty_is_dapos_soft_punishment():
    # L_max 20, L_cache 4: 0 up to 16, then linear to -1 at 20, -1 beyond
    L_max, L_cache = 20, 4
    for n in range(0, 25):
        if n <= L_max - L_cache:
            want = 0.0
        elif n <= L_max:
            want = ((L_max - L_cache) - n) / L_cache
        else:
            want = -1.0
        assert overlong_penalty(n, max_len=L_max, buffer=L_cache) == pytest.approx(want)
    assert overlong_penalty(18, max_len=20, buffer=4, penalty=0.5) == pytest.approx(-0.25)
    samples = group("a", [1.0, 0.0], n_tokens=19) + group("b", [1.0], n_tokens=2) + group("c", [1.0], failed=(0,))
    m = apply_overlong_penalty(samples, max_len=20, buffer=4, penalty=1.0)
    assert [s.reward for s in samples[:3]] == pytest.approx([0.25, -0.75, 1.0]) and math.isnan(samples[3].reward)
    assert m["overlong_frac"] == pytest.approx(2 / 3) and m["overlong_penalty"] == pytest.approx(-1.5 / 3)


def test_kl_in_reward_subtracts_the_masked_kl_sum():
    samples = group("a", [1.0, 0.0], n_tokens=3) + group("b", [1.0], failed=(0,))
    samples[1].loss_mask = [1, 0, 1]
    old = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.0, -9.0, -1.0]), torch.zeros(3)]
    ref = [torch.tensor([-1.5, -1.0, -0.5]), torch.tensor([-0.5, 0.0, -3.0]), torch.zeros(3)]
    m = apply_kl_in_reward(samples, old, ref, kl_coef=0.1, estimator="k1", clamp=None)
    k1 = [0.5 + -1.0 + 0.0, -0.5 + 2.0]  # masked token of sample 1 left out
    assert samples[0].reward == pytest.approx(1.0 - 0.1 * k1[0])
    assert samples[1].reward == pytest.approx(0.0 - 0.1 * k1[1]) and math.isnan(samples[2].reward)
    assert m["kl_reward"] == pytest.approx(sum(k1) / 5) and m["kl_reward_penalty"] == pytest.approx(0.1 * sum(k1) / 2)


# ----------------------------------------------------------------------------- config and preflight
def fields(config) -> set[str]:
    return {v.field for v in preflight(config, load_kernel())}


def test_dr_grpo_is_one_name_and_half_of_it_is_a_violation():
    c = load_config(None, ["algorithm.estimator=dr_grpo"])
    assert c.algorithm.loss_agg == "seq-mean-token-sum-norm"
    assert "algorithm.loss_agg" not in fields(c) and "algorithm.estimator" not in fields(c)
    c = load_config(None, ["algorithm.estimator=dr_grpo", "algorithm.loss_agg=token-mean"])
    assert "algorithm.loss_agg" in fields(c)
    c = load_config(None, ["algorithm.loss_agg=seq-mean-token-sum-norm"])  # grpo (std) + Dr. GRPO's norm
    assert "algorithm.estimator" in fields(c)


def test_preflight_checks_the_new_options():
    bad = load_config(None, ["algorithm.loss=gspo", "algorithm.loss_options={clip_lo: 0.1}",
                             "algorithm.kl_form=reward", "algorithm.dynamic_sampling.enabled=true", "rollout.n=1",
                             "algorithm.overlong.enabled=true", "algorithm.overlong.buffer_tokens=16",
                             "rollout.max_new_tokens=16"])
    got = fields(bad)
    assert {"algorithm.loss_options.clip_lo", "algorithm.kl_form", "algorithm.dynamic_sampling.enabled",
            "algorithm.overlong.buffer_tokens"} <= got
    for ok in (["algorithm.loss=gspo", "algorithm.loss_options={clip_low: 0.001}"],
               ["algorithm.loss_options={clip_ratio_c: 3}"]):
        assert not {f for f in fields(load_config(None, ok)) if f.startswith("algorithm")}

