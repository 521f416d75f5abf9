"""Issue 36: ``algorithm.group_layer: root | turn | fork`` in the estimators, checked against advantages
computed by hand (the arithmetic is written out next to each expected number).

The tree: 2 roots (launches ``p1@t``, ``p2@t``), each with 2 trajectories forked once (``/0`` before turn 1,
``/1`` before turn 1 or 2) into 2 branches: 8 leaf samples, with 1 to 4 turns of uneven lengths. Each
branch shares its parent's Parts up to the fork (built by copying the parent, as a fork does).
"""

from __future__ import annotations

import math

import pytest
import torch

from unirl.algorithms.advantages import dr_grpo, gae, grpo, reinforce_pp, rloo
from unirl.config import AlgorithmSection, load_config
from unirl.kernel import load_kernel
from unirl.kernel.errors import ConfigError
from unirl.preflight import preflight
from unirl.samples import Sample, fork_id

ROOT = AlgorithmSection()
TURN = AlgorithmSection(group_layer="turn")
FORK = AlgorithmSection(group_layer="fork")
S2 = math.sqrt(2.0)
EPS = 1e-6


def add_turn(s: Sample, model: int, obs: int) -> None:
    k = s.turns
    s.append_model_turn([100 + k] * model, [-0.5] * model, 0, "stop")
    if obs:
        s.append_observation([200 + k] * obs)


def branch(parent: Sample, at: int, b: int, reward: float, rest: list[tuple[int, int]]) -> Sample:
    """Branch ``b`` of the fork of ``parent`` before its turn ``at``; ``rest``: (model, obs) tokens per turn."""
    assert parent.turns == at
    s = parent.copy()
    s.id = fork_id(parent.id, at, b)
    for m, o in rest:
        add_turn(s, m, o)
    s.reward = reward
    return s


def trunk(sid: str, turns: list[tuple[int, int]]) -> Sample:
    s = Sample(id=sid, prompt_ids=[1, 2])
    for m, o in turns:
        add_turn(s, m, o)
    return s


def tree() -> list[Sample]:
    a, b = trunk("p1@t/0", [(2, 1)]), trunk("p1@t/1", [(1, 2), (3, 1)])
    c, d = trunk("p2@t/0", [(2, 2)]), trunk("p2@t/1", [(1, 1)])
    return [
        branch(a, 1, 0, 1.0, [(2, 2), (1, 0)]),          # p1@t/0/f1.0: 3 turns
        branch(a, 1, 1, 0.0, [(4, 0)]),                  # p1@t/0/f1.1: 2 turns
        branch(b, 2, 0, 1.0, [(2, 0)]),                  # p1@t/1/f2.0: 3 turns
        branch(b, 2, 1, 1.0, [(1, 1), (2, 0)]),          # p1@t/1/f2.1: 4 turns
        branch(c, 1, 0, 0.0, [(3, 0)]),                  # p2@t/0/f1.0: 2 turns
        branch(c, 1, 1, 0.0, []),                        # p2@t/0/f1.1: 1 turn (stopped at the fork)
        branch(d, 1, 0, 1.0, [(2, 1), (1, 0)]),          # p2@t/1/f1.0: 3 turns
        branch(d, 1, 1, 0.0, [(2, 0)]),                  # p2@t/1/f1.1: 2 turns
    ]


def per_turn(s: Sample, values: list[float]) -> torch.Tensor:
    """The expected per-token tensor: turn k's tokens (its model Part and observation) get values[k]."""
    out = torch.zeros(len(s.response_ids))
    for t, v in zip(s.turn_list(), values, strict=True):
        out[t.start:t.end] = v
    return out


def check(res, samples: list[Sample], expected: list[list[float]]) -> None:
    for s, a, want in zip(samples, res.advantages, expected, strict=True):
        if len(want) == 1:
            want = want * s.turns
        torch.testing.assert_close(a, per_turn(s, want), atol=1e-6, rtol=0, msg=s.id)


def test_the_tree_is_what_the_arithmetic_below_assumes():
    t = tree()
    assert [s.turns for s in t] == [3, 2, 3, 4, 2, 1, 3, 2]
    assert [s.fork_group_id for s in t] == ["p1@t/0/f1"] * 2 + ["p1@t/1/f2"] * 2 + ["p2@t/0/f1"] * 2 + ["p2@t/1/f1"] * 2
    assert t[0].response_ids[:3] == t[1].response_ids[:3]  # the branches share the parent's turn 0


def test_root_layer_groups_each_launch():
    # p1 rewards [1, 0, 1, 1]: mean 0.75, centred [.25, -.75, .25, .25],
    #   unbiased var = (3 * .0625 + .5625) / 3 = 0.25, std 0.5 -> A = centred / 0.5 = [.5, -1.5, .5, .5]
    # p2 rewards [0, 0, 1, 0]: mean 0.25, centred [-.25, -.25, .75, -.25], std 0.5 -> [-.5, -.5, 1.5, -.5]
    t = tree()
    d = 0.5 + EPS
    check(grpo(t, options={}, algorithm=ROOT), t,
          [[.25 / d], [-.75 / d], [.25 / d], [.25 / d], [-.25 / d], [-.25 / d], [.75 / d], [-.25 / d]])
    # dr_grpo: the centred rewards themselves
    check(dr_grpo(t, options={}, algorithm=ROOT), t, [[.25], [-.75], [.25], [.25], [-.25], [-.25], [.75], [-.25]])


def test_fork_layer_compares_the_branches_of_one_fork_point():
    # each fork group has 2 branches, rewards (a, b): mean (a+b)/2, centred +-(a-b)/2, unbiased std |a-b|/sqrt(2)
    # p1@t/0/f1 (1, 0): +-0.5 / (1/sqrt(2) + eps)        p1@t/1/f2 (1, 1): equal -> 0, 0
    # p2@t/0/f1 (0, 0): 0, 0                             p2@t/1/f1 (1, 0): +-0.5 / (1/sqrt(2) + eps)
    t = tree()
    h = 0.5 / (1 / S2 + EPS)
    res = grpo(t, options={}, algorithm=FORK)
    check(res, t, [[h], [-h], [0.0], [0.0], [0.0], [0.0], [h], [-h]])
    assert res.metrics["zero_std_group_frac"] == 2 / 4
    # rloo over 2 branches: r_i - r_other: p1@t/0/f1 (1, -1), p2@t/1/f1 (1, -1)
    check(rloo(t, options={}, algorithm=FORK), t, [[1.0], [-1.0], [0.0], [0.0], [0.0], [0.0], [1.0], [-1.0]])


def test_turn_layer_compares_turn_k_with_the_trajectories_that_reached_it():
    t = tree()
    # p1, turns per leaf [3, 2, 3, 4], rewards [1, 0, 1, 1]
    #   turn 0 and turn 1: all four -> as at the root: centred [.25, -.75, .25, .25]
    #   turn 2: leaves 0, 2, 3 with rewards [1, 1, 1] -> 0;  turn 3: leaf 3 alone -> 0 (no baseline)
    # p2, turns per leaf [2, 1, 3, 2], rewards [0, 0, 1, 0]
    #   turn 0: all four -> centred [-.25, -.25, .75, -.25]
    #   turn 1: leaves 4, 6, 7 (leaf 5 has one turn), rewards [0, 1, 0]: mean 1/3 -> [-1/3, 2/3, -1/3]
    #   turn 2: leaf 6 alone -> 0
    dr = dr_grpo(t, options={}, algorithm=TURN)
    check(dr, t, [[.25, .25, 0.0], [-.75, -.75], [.25, .25, 0.0], [.25, .25, 0.0, 0.0],
                  [-.25, -1 / 3], [-.25], [.75, 2 / 3, 0.0], [-.25, -1 / 3]])
    # grpo: turn 0/1 of p1 and turn 0 of p2 divide by std 0.5 (see the root test); turn 1 of p2:
    #   unbiased var = ((1/3)^2 + (2/3)^2 + (1/3)^2) / 2 = 1/3, std = 1/sqrt(3)
    d, d3 = 0.5 + EPS, 1 / math.sqrt(3) + EPS
    check(grpo(t, options={}, algorithm=TURN), t,
          [[.25 / d, .25 / d, 0.0], [-.75 / d, -.75 / d], [.25 / d, .25 / d, 0.0], [.25 / d, .25 / d, 0.0, 0.0],
           [-.25 / d, -1 / 3 / d3], [-.25 / d], [.75 / d, 2 / 3 / d3, 0.0], [-.25 / d, -1 / 3 / d3]])
    # groups: p1 turns 0..3 (4) + p2 turns 0..2 (3) = 7 live groups; all-equal: p1 turn 2, p1 turn 3, p2 turn 2
    assert dr.metrics["zero_std_group_frac"] == pytest.approx(3 / 7)


def test_fork_layer_on_samples_without_forks_is_the_root_layer_bit_for_bit():
    s = [trunk(f"p{i}@t/{j}", [(2 + j, 1), (1, 0)]) for i in range(2) for j in range(3)]
    for x, r in zip(s, [1.0, 0.0, 0.5, 0.25, 0.0, 1.0], strict=True):
        x.reward = r
    a = grpo(s, options={}, algorithm=ROOT)
    b = grpo(s, options={}, algorithm=FORK)
    assert all(torch.equal(x, y) for x, y in zip(a.advantages, b.advantages, strict=True))


def test_failed_samples_stay_out_of_every_layer():
    t = tree()
    t[0].mark_failed("engine died")  # p1 turn groups lose leaf 0
    res = dr_grpo(t, options={}, algorithm=TURN)
    assert torch.count_nonzero(res.advantages[0]) == 0
    # p1 turn 0 without leaf 0: rewards [0, 1, 1], mean 2/3 -> leaf 1: -2/3, leaves 2, 3: 1/3
    assert res.advantages[1][0].item() == pytest.approx(-2 / 3)
    assert res.advantages[3][0].item() == pytest.approx(1 / 3)


def test_gae_per_turn_is_the_turn_level_recursion():
    # one trajectory: turn 0 = model 2 + obs 2 tokens, turn 1 = model 3 + obs 1, turn 2 = model 2
    s = trunk("p1@t/0", [(2, 2), (3, 1), (2, 0)])
    s.reward = 2.0
    v = torch.tensor([0.5, 0.1, 0.2, 0.3, 0.8, 0.4, 0.4, 0.4, 1.5, 0.6])
    g, lam = 0.9, 0.8
    alg = AlgorithmSection(group_layer="turn", gamma=g, lam=lam)
    # turn starts 0, 4, 8: V_0 = v[0] = 0.5, V_1 = v[4] = 0.8, V_2 = v[8] = 1.5; the reward 2.0 is on turn 2
    #   delta_2 = 2.0 + g * 0   - 1.5 = 0.5                 A_2 = 0.5
    #   delta_1 = 0   + g * 1.5 - 0.8 = 0.55                A_1 = 0.55 + g*lam*0.5   = 0.91
    #   delta_0 = 0   + g * 0.8 - 0.5 = 0.22                A_0 = 0.22 + g*lam*0.91  = 0.8752
    a0, a1, a2 = 0.22 + g * lam * (0.55 + g * lam * 0.5), 0.55 + g * lam * 0.5, 0.5
    assert (a0, a1, a2) == pytest.approx((0.8752, 0.91, 0.5))
    res = gae([s], options={"whiten": False}, algorithm=alg, values=[v])
    # model tokens carry A_k, observation tokens 0 (masked); returns R_k = A_k + V_k on every token of turn k
    want_a = torch.tensor([a0, a0, 0, 0, a1, a1, a1, 0, a2, a2])
    want_r = torch.tensor([a0 + .5] * 4 + [a1 + .8] * 4 + [a2 + 1.5] * 2)
    torch.testing.assert_close(res.advantages[0], want_a, atol=1e-6, rtol=0)
    torch.testing.assert_close(res.returns[0], want_r, atol=1e-6, rtol=0)
    # the root layer is unchanged token-level GAE (different numbers: it steps per token)
    root = gae([s], options={"whiten": False}, algorithm=AlgorithmSection(gamma=g, lam=lam), values=[v])
    assert not torch.allclose(root.advantages[0], want_a)


def test_an_estimator_refuses_a_layer_it_does_not_implement():
    s = tree()
    with pytest.raises(ConfigError, match="algorithm.group_layer: estimator 'reinforce_pp' cannot group by 'turn'"):
        reinforce_pp(s, options={}, algorithm=TURN)
    with pytest.raises(ConfigError, match="'gae' cannot group by 'fork'; set it to one of: root, turn"):
        gae(s, options={}, algorithm=FORK, values=[torch.zeros(len(x.response_ids)) for x in s])


RECIPE = "recipes/arith-tiny.yaml"


@pytest.mark.parametrize(("words", "needle"), [
    (["algorithm.estimator=reinforce_pp", "algorithm.group_layer=turn"],
     "set algorithm.group_layer to one of: root"),
    (["algorithm.estimator=gae", "actor.value_head=true", "algorithm.group_layer=fork"],
     "set algorithm.group_layer to one of: root, turn"),
])
def test_preflight_names_the_field_and_the_fix(words, needle):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    bad = [v for v in preflight(load_config(str(root / RECIPE), words), load_kernel())
           if v.field == "algorithm.group_layer" and "cannot group by" in v.message]
    assert len(bad) == 1 and needle in bad[0].fix, bad
    # fork with something that forks: no group_layer violation (fork without branching is an INERT rule)
    branching = ["algorithm.group_layer=fork", "rollout.branching={at_turns: [0], n: 2}"]
    ok = [v for v in preflight(load_config(str(root / RECIPE), branching), load_kernel())
          if v.field == "algorithm.group_layer"]
    assert ok == []
    inert = [v for v in preflight(load_config(str(root / RECIPE), ["algorithm.group_layer=fork"]), load_kernel())
             if v.field == "algorithm.group_layer"]
    assert len(inert) == 1 and "rollout.branching is not set" in inert[0].message


def test_a_bad_layer_is_a_config_error_naming_the_field():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    with pytest.raises(ConfigError, match=r"algorithm\.group_layer"):
        load_config(str(root / RECIPE), ["algorithm.group_layer=leaf"])
