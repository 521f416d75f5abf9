"""Issue 36 item 5: ``rollout.branching`` in the agentic controller, on the real embedded engine.

Oracles: the parent's Parts (each branch must start with exactly the sibling's prefix up to the fork),
the path ids (``.../f{k}.{b}``), the tokens the engine's decoder actually prefilled
(``unirl.api.count_prefill``: the shared prefix of a fork goes through the model once), and
preflight's violations named by field.
"""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
from agentic_support import CountdownEnv, drawer
from unirl_agentic.controller import AgenticRolloutController

from unirl.api import (
    BranchingSection,
    Qwen3Adapter,
    RunConfig,
    SamplingParams,
    count_prefill,
    default_runtime,
    hookimpl,
    load_kernel,
)
from unirl.config import AlgorithmSection
from unirl.engine.torch_engine import TorchEngine
from unirl.preflight import preflight


@pytest.fixture(scope="module")
def counted(tok):
    cfg = RunConfig()
    eng = TorchEngine(config=cfg, adapter=Qwen3Adapter(), tokenizer=tok, runtime=default_runtime(cfg))
    yield eng, count_prefill(eng)
    eng.close()


def test_trajectories_fork_at_the_turn_and_branches_share_the_prefix_prefilled_once(counted, tok):
    from unirl.algorithms.advantages import grpo

    eng, prefilled = counted
    prefilled.clear()
    env = CountdownEnv(lambda s: 3)  # every trajectory takes 3 model turns
    ctl = AgenticRolloutController(eng, env, tok, reward_fn=lambda text, s: 0.0, base_seed=7,
                                   branching=BranchingSection(at_turns=[1], n=3))
    try:
        out = ctl.collect(drawer(tok), groups=2, n=2, sampling=SamplingParams(max_new_tokens=4, temperature=1.0))
        stats = ctl.metrics()
    finally:
        ctl.close()
    assert stats["agentic/forks"] == 4.0
    assert len(out) == 2 * 2 * 3  # each of the 4 launched trajectories replaced by 3 branches
    assert all(re.fullmatch(r"p\d@agentic1\.0/\d/f1\.[012]", s.id) for s in out), [s.id for s in out]
    assert env.live() == [] and all(v == 1 for v in env.closes.values())  # parents closed once, branches too
    assert len(env.closes) == 4 + 12
    by_fork = defaultdict(list)
    for s in out:
        by_fork[s.fork_group_id].append(s)
    assert sorted(len(v) for v in by_fork.values()) == [3, 3, 3, 3]
    prefilled_by_requests = 0
    for branches in by_fork.values():
        cut = branches[0].turn(1).start  # the fork point: before model turn 1
        for b in branches:
            assert b.turns == 3 and b.status != "failed"
            assert b.parts[:3] == branches[0].parts[:3]  # prompt, turn 0, its observation: the shared Parts
            assert b.response_ids[:cut] == branches[0].response_ids[:cut]
        assert len({tuple(b.response_ids[cut:]) for b in branches}) > 1  # they branched
        # the fork turn: one branch prefilled the shared context, the others got it from that prefill
        turn1 = sorted((b.requests[1].cached_tokens, b.requests[1].prompt_tokens) for b in branches)
        assert turn1[0][0] == 0 and all(c == p for c, p in turn1[1:]), turn1
        # what the drive prefilled: the parent's turn 0 once, then each branch's turns 1 and 2
        reqs = [branches[0].requests[0]] + [r for b in branches for r in b.requests[1:]]
        prefilled_by_requests += sum(r.prompt_tokens - r.cached_tokens for r in reqs)
    unshared = sum(r.prompt_tokens for s in out for r in s.requests[1:]) + sum(
        v[0].requests[0].prompt_tokens for v in by_fork.values())
    print(f"\nbranching drive: {sum(prefilled)} context tokens prefilled, {unshared} without sharing")
    assert sum(prefilled) == prefilled_by_requests < unshared
    # algorithm.group_layer: fork groups the branches of each fork point
    for s in out:
        s.reward = float(s.response_ids[-1] % 2)
    res = grpo(out, options={}, algorithm=AlgorithmSection(group_layer="fork"))
    for branches in by_fork.values():
        idx = [out.index(b) for b in branches]
        assert abs(sum(float(res.advantages[i][0]) for i in idx)) < 1e-5  # centred within the fork group


def test_a_stateful_environment_cannot_branch(counted, tok):
    class Stateful(CountdownEnv):
        stateful = True

    with pytest.raises(ValueError, match="rollout.branching.*stateful"):
        AgenticRolloutController(counted[0], Stateful(lambda s: 2), tok, reward_fn=lambda t, s: 0.0,
                                 branching=BranchingSection(at_turns=[1], n=2))


def _violations(**rollout) -> dict[str, str]:
    base = {"environment": "tool_env", "tools": ["calculator"], "controller": "agentic"}
    cfg = RunConfig(rollout={**base, **rollout}, algorithm={"group_layer": "fork"},
                    plugins={"agentic": {"max_turns": 3}})
    return {v.field: f"{v.message} | {v.fix}" for v in preflight(cfg, load_kernel())}


def test_preflight_names_the_field_and_the_fix():
    assert not {k for k in _violations(branching={"at_turns": [1], "n": 2}) if "branching" in k or "group_layer" in k}
    got = _violations(branching={"at_turns": [1, 3], "n": 2})
    assert "[3] are never reached" in got["rollout.branching.at_turns"] and "below 3" in got["rollout.branching.at_turns"]
    cfg = RunConfig(rollout={"branching": {"at_turns": [0], "n": 2}})  # batch controller, group_layer root
    v = {x.field: x for x in preflight(cfg, load_kernel())}
    assert "set algorithm.group_layer: fork" in v["algorithm.group_layer"].fix
    assert "'batch' does not fork" in v["rollout.branching"].message
    with pytest.raises(Exception, match="n"):
        RunConfig(rollout={"branching": {"at_turns": [1], "n": 1}})
    with pytest.raises(Exception, match="distinct"):
        RunConfig(rollout={"branching": {"at_turns": [1, 1], "n": 2}})


class _Seen:
    """Train and eval samples as the trainer saw them (``unirl_on_rollout``) and every trained one."""

    def __init__(self):
        self.rollouts: dict[str, list] = {"train": [], "eval": []}
        self.trained: list = []

    @hookimpl
    def unirl_on_rollout(self, phase, step, version, samples, config):
        self.rollouts.setdefault(phase, []).extend(s.copy() for s in samples)

    @hookimpl
    def unirl_before_backward(self, ctx):
        self.trained.extend(s.id for s in ctx.samples)


@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
@pytest.mark.slow
def test_the_branching_recipe_learns_through_the_trainer(tmp_path):
    """recipes/agentic-calc-branching-tiny.yaml as shipped, through ``train()``: the warm start, then GRPO
    where every slot forks at turn 0 into ``rollout.branching.n`` branches compared with each other
    (``group_layer: fork``). Held-out accuracy rises by >= 0.15 over the warm start (seed 0 gave
    0.570 -> 0.820 on 2026-12-04) and the policy calls the tool more; every trained sample is a branch,
    the eval controller does not branch."""
    from pathlib import Path

    from unirl.api import load_config, train

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "agentic-calc-branching-tiny.yaml"
    seen = _Seen()
    config = load_config(recipe, [f"run.output_dir={tmp_path}", "trainer.progress=false", "trainer.plot=false",
                                  "trainer.export_hf=false"])
    result = train(config, load_kernel(extra=[("seen", seen)]))
    steps, prompts = config.trainer.steps, config.trainer.prompts_per_step
    slots, branches = config.rollout.n, config.rollout.branching.n
    assert result.steps_done == steps
    train_ids = [s.id for s in seen.rollouts["train"]]
    assert len(train_ids) == steps * prompts * slots * branches
    assert all(re.fullmatch(rf"p\d+@train\d+\.\d+/\d/f0\.[0-{branches - 1}]", i) for i in train_ids), train_ids[:4]
    assert set(seen.trained) == set(train_ids)
    assert seen.rollouts["eval"] and not any("/f" in s.id for s in seen.rollouts["eval"])
    assert all(h["agentic/forks"] == prompts * slots for h in result.history if "agentic/forks" in h)
    evals = [h for h in result.history if "eval" in h]
    before, after = evals[0], evals[-1]
    report = (f"branching: held-out {before['eval']:.3f} -> {after['eval']:.3f}, mean turns "
              f"{before['eval_agentic/mean_turns']:.2f} -> {after['eval_agentic/mean_turns']:.2f}")
    print(report)
    assert after["eval"] - before["eval"] >= 0.15, report
    assert after["eval_agentic/mean_turns"] > before["eval_agentic/mean_turns"], report
