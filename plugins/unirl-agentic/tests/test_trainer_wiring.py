"""The agentic controller inside the trainer (``rollout.controller: agentic``): the demo recipe runs through
``train()`` once, as it is (SFT warm start on tool traces, GRPO with the calculator), and two tests read
that one run: on every trained micro-batch the tool tokens carry loss mask 0 and the token ids are the ids
the engine generated; and the demo learns (held-out accuracy +0.15 over the warm start, more tool turns)."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

from unirl.api import Sample, hookimpl, load_config, load_kernel

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "agentic-calc-tiny.yaml"


class Spy:
    """Sees every trained micro-batch, before backward, and every held-out eval's samples."""

    def __init__(self):
        self.trained: list[Sample] = []
        self.evals: dict[int, list[Sample]] = {}

    @hookimpl
    def unirl_before_backward(self, ctx):
        self.trained.extend(s.copy() for s in ctx.samples)

    @hookimpl
    def unirl_on_rollout(self, phase, step, version, samples, config):
        if phase == "eval":
            self.evals[step] = [s.copy() for s in samples]


@dataclass
class DemoRun:
    history: list[dict]
    trained: list[Sample]
    generated: dict[str, list[list[int]]]  # every model turn as the engine appended it, by sample id
    seconds: float
    evals: dict[int, list[Sample]]  # the in-training evals' samples, by step
    config: object


@pytest.fixture(scope="module")
def agentic_run(tmp_path_factory) -> DemoRun:
    """The demo recipe end to end, once for this module (its cost is the demo's: the learning test needs it
    whole, the mask test rides along)."""
    from unirl.api import train

    turns: dict[str, list[list[int]]] = defaultdict(list)
    original = Sample.append_model_turn

    def record(self, token_ids, logprobs, version, finish_reason, *, text="", role="model"):
        turns[self.id].append([int(t) for t in token_ids])
        return original(self, token_ids, logprobs, version, finish_reason, text=text, role=role)

    spy = Spy()
    out = tmp_path_factory.mktemp("demo")
    config = load_config(RECIPE, [f"run.output_dir={out}", "trainer.progress=false", "trainer.plot=false",
                                  "trainer.export_hf=true", "trainer.save_every=0"])
    t0 = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Sample, "append_model_turn", record)
        result = train(config, load_kernel(extra=[("spy", spy)]))
    assert result.steps_done == config.trainer.steps
    return DemoRun(result.history, spy.trained, dict(turns), time.perf_counter() - t0, spy.evals, config)


@pytest.mark.slow
def test_train_never_trains_tool_tokens_and_trains_the_generated_ids(agentic_run):
    assert all("agentic/mean_turns" in h for h in agentic_run.history if h["step"] > 0)
    assert "eval_agentic/mean_turns" in agentic_run.history[0]
    trained = [s for s in agentic_run.trained if not s.failed]
    assert len(trained) >= 8
    with_tool = [s for s in trained if any(g.kind == "observation" for g in s.segments)]
    assert with_tool, "no trained trajectory called the calculator"
    for s in trained:
        model_ids = []
        for g in s.segments:
            mask = set(s.loss_mask[g.start:g.end])
            if g.kind == "observation":
                assert mask == {0}, (s.id, g)  # the tool's turn is never trained
            else:
                assert mask == {1}, (s.id, g)
                model_ids.append(s.response_ids[g.start:g.end])
        # the model's ids are exactly the ids the engine generated, turn by turn (no re-tokenization)
        assert model_ids == agentic_run.generated[s.id], s.id


@pytest.mark.slow
def test_demo_learns_to_use_the_calculator(agentic_run):
    """Held-out accuracy (avg@k, the same eval seeds each time) rises by >= 0.15 absolute over the warm
    start, and the policy calls the tool more (mean model turns: 1 = answered unaided, 2 = called the
    calculator, then answered)."""
    evals = [h for h in agentic_run.history if "eval" in h]
    before, after = evals[0], evals[-1]
    report = (f"demo ({agentic_run.seconds:.0f} s): held-out accuracy {before['eval']:.3f} -> {after['eval']:.3f}, "
              f"mean turns {before['eval_agentic/mean_turns']:.2f} -> {after['eval_agentic/mean_turns']:.2f}; "
              "evals " + ", ".join(f"step {h['step']}: {h['eval']:.3f}" for h in evals))
    print(report)
    assert before["step"] == 0 and after["step"] == max(h["step"] for h in agentic_run.history)
    assert after["eval"] - before["eval"] >= 0.15, report
    assert after["eval_agentic/mean_turns"] > before["eval_agentic/mean_turns"], report


@pytest.mark.slow
def test_unirl_eval_scores_the_trained_policy_as_the_in_training_eval_did(agentic_run, tmp_path):
    """``unirl eval`` on the run's exported model goes through the recipe's eval controller (multi-turn,
    with the calculator), so each held-out prompt gets exactly the rewards the last in-training eval gave
    it (same seeds, same weights), and the policy calls the tool."""
    import json

    from unirl.evaluation import evaluate_model

    last = max(agentic_run.evals)
    config = agentic_run.config
    cli = load_config(RECIPE, [f"run.output_dir={tmp_path}", "trainer.progress=false",
                               f"model.path={config.run_dir / 'hf'}"])
    result = evaluate_model(cli, load_kernel(), split="eval", say=lambda _: None)
    rows = [json.loads(line) for line in result.per_prompt.read_text().splitlines()]
    trained: dict[str, list[float]] = {}
    for s in sorted(agentic_run.evals[last], key=lambda s: s.id):
        trained.setdefault(s.prompt_id, []).append(s.reward)
    assert {r["prompt_id"]: r["rewards"] for r in rows} == trained
    assert result.avg_at_k == pytest.approx(agentic_run.history[-1]["eval"], abs=0)
    tool_turns = sum(any(g.kind == "observation" for g in s.segments) for s in agentic_run.evals[last])
    assert tool_turns > 0, "no held-out trajectory called the calculator"


# a short run for the async test below (no learning asked of it)
SHORT = ["trainer.progress=false", "trainer.plot=false", "trainer.export_hf=false", "trainer.steps=2",
         "trainer.prompts_per_step=4", "rollout.n=4", "trainer.eval_every=0", "data.arith.n_train=256",
         "data.arith.n_eval=4", "trainer.eval_k=2"]


class Rollouts:
    """The group ids and staleness stamps of each train step's samples (``unirl_on_rollout``)."""

    def __init__(self):
        self.groups: dict[int, set[str]] = {}
        self.staleness: dict[int, set[int]] = {}
        self.tokens: list[tuple[int, int, dict]] = []  # (step, collect version, each sample's token versions)

    @hookimpl
    def unirl_on_rollout(self, phase, step, version, samples, config):
        if phase == "train":
            self.groups.setdefault(step, set()).update(s.group_id for s in samples)
            self.staleness.setdefault(step, set()).update(s.meta.get("staleness", -1) for s in samples)
            for s in samples:  # the version that generated each model token (tool turns: -1, masked)
                model = [v for v, m in zip(s.versions, s.loss_mask, strict=True) if m]
                self.tokens.append((step, version, {"ids": s.group_id, "versions": model, "meta": dict(s.meta)}))


@pytest.mark.slow
def test_async_agentic_run_checkpoints_the_carried_groups_and_the_resume_trains_them(tmp_path):
    """rollout.mode: async drives the agentic controller (the next step's collect prefetched while a step
    trains, staleness stamped per trajectory). Partial rollout (over_generate 1.5: 3 groups open for 2)
    leaves a group beyond a step's target in the controller, its prompt already drawn from the cursor:
    the checkpoint saves it and the resumed run trains it, so nothing drawn is lost."""
    import torch

    from unirl.api import train

    over = [f"run.output_dir={tmp_path}", *SHORT, "sft.steps=0", "trainer.prompts_per_step=2",
            "rollout.n=2", "rollout.max_new_tokens=8", "plugins.agentic.over_generate=1.5", "trainer.save_every=2",
            "rollout.mode=async", "rollout.max_staleness=1"]
    # the first run ends at step 2 (its checkpoint), the resumed one raises trainer.steps to 3
    config = load_config(ROOT / "recipes" / "agentic-calc-tiny.yaml", [*over, "trainer.steps=2"])
    first = Rollouts()
    train(config, load_kernel(extra=[("rollouts", first)]))
    # step 1's batch was collected in the background during step 0, under the weights before its sync
    assert first.staleness == {0: {0}, 1: {1}}
    # every model token records the version that generated it; a fresh trajectory's staleness is the
    # ledger version at training minus its oldest token's, within rollout.max_staleness
    for step, _, seen in first.tokens:
        assert seen["versions"] and all(v >= 1 for v in seen["versions"])  # no unstamped model token
        assert seen["meta"]["min_version"] == min(seen["versions"])
        assert seen["meta"]["staleness"] == step + 1 - min(seen["versions"]) <= 1  # version step+1 trains step
    state = torch.load(config.run_dir / "checkpoints" / "step_000002" / "extra.pt", weights_only=False)["trainer"]
    carried = state["controller"]
    kept = {g[0].group_id for g in carried["complete"]} | {s.group_id for s in carried["live"]}
    # drive 1 opened 3 groups for 2 (one left over); drive 2 took it and opened 2 more: one is carried
    assert len(kept) == 1 and not kept & (first.groups[0] | first.groups[1])  # launched, not yet trained

    resumed = Rollouts()
    config = load_config(ROOT / "recipes" / "agentic-calc-tiny.yaml", [*over, "trainer.steps=3", "run.resume=true"])
    result = train(config, load_kernel(extra=[("rollouts", resumed)]))
    assert result.steps_done == 3
    assert kept < resumed.groups[2]  # the carried group is trained at step 3, beside one fresh group


class Published:
    """Every ``unirl_on_weights_published`` call, by version."""

    def __init__(self):
        self.versions: list[int] = []

    @hookimpl
    def unirl_on_weights_published(self, version, receipts, config):
        self.versions.append(version)


@pytest.mark.parametrize("mode", [[], ["rollout.mode=async", "rollout.max_staleness=1"]], ids=["sync", "async"])
def test_the_agentic_controller_publishes_each_version_once(tmp_path, mode):
    """The same one publish path as the batch driver's (core's test_rollout_driver), through the agentic
    controller in both modes: the initial version, then one per step, each exactly once."""
    from unirl.api import train

    spy = Published()
    config = load_config(RECIPE, [f"run.output_dir={tmp_path}", *SHORT, "sft.steps=0", "rollout.max_new_tokens=8",
                                  *mode])
    result = train(config, load_kernel(extra=[("published", spy)]))
    assert spy.versions == [1, 2, 3] and result.history[-1]["version"] == 3
    assert len((config.run_dir / "weights.log").read_text().splitlines()) == 3
