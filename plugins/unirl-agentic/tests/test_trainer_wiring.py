"""The agentic controller inside the trainer (``rollout.controller: agentic``): the demo recipe runs through
``train()`` (SFT on tool traces, GRPO with the calculator), and on every trained micro-batch the tool
tokens carry loss mask 0 and the token ids are the ids the engine generated."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from unirl.api import Sample, hookimpl, load_config, load_kernel

ROOT = Path(__file__).resolve().parents[3]


class Spy:
    """Sees every trained micro-batch, before backward."""

    def __init__(self):
        self.trained: list[Sample] = []

    @hookimpl
    def unirl_before_backward(self, ctx):
        self.trained.extend(s.copy() for s in ctx.samples)


@pytest.fixture
def generated(monkeypatch):
    """Every model turn as the engine appends it, by sample id: the ids as generated."""
    turns: dict[str, list[list[int]]] = defaultdict(list)
    original = Sample.append_model_turn

    def record(self, token_ids, logprobs, version, finish_reason, *, text=""):
        turns[self.id].append([int(t) for t in token_ids])
        return original(self, token_ids, logprobs, version, finish_reason, text=text)

    monkeypatch.setattr(Sample, "append_model_turn", record)
    return turns


# a short warm start already makes the tiny model call the calculator (the format is learnt first)
SHORT = ["trainer.progress=false", "trainer.plot=false", "trainer.export_hf=false", "sft.steps=40",
         "sft.batch_size=16", "trainer.steps=2", "trainer.prompts_per_step=4", "rollout.n=4", "trainer.eval_every=0",
         "data.arith.n_train=256", "data.arith.n_eval=4", "trainer.eval_k=2"]


@pytest.mark.slow
def test_train_never_trains_tool_tokens_and_trains_the_generated_ids(tmp_path, generated):
    from unirl.trainer.loop import train

    spy = Spy()
    kernel = load_kernel(extra=[("spy", spy)])
    config = load_config(ROOT / "recipes" / "agentic-calc-tiny.yaml", [f"run.output_dir={tmp_path}", *SHORT])
    result = train(config, kernel)
    assert result.steps_done == 2
    assert all("agentic/mean_turns" in h for h in result.history if h["step"] > 0)
    assert "eval_agentic/mean_turns" in result.history[0]

    trained = [s for s in spy.trained if not s.failed]
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
        assert model_ids == generated[s.id], s.id



class Rollouts:
    """The group ids and staleness stamps of each train step's samples (``unirl_on_rollout``)."""

    def __init__(self):
        self.groups: dict[int, set[str]] = {}
        self.staleness: dict[int, set[int]] = {}

    @hookimpl
    def unirl_on_rollout(self, phase, step, version, samples, config):
        if phase == "train":
            self.groups.setdefault(step, set()).update(s.group_id for s in samples)
            self.staleness.setdefault(step, set()).update(s.meta.get("staleness", -1) for s in samples)


@pytest.mark.slow
def test_async_agentic_run_checkpoints_the_carried_groups_and_the_resume_trains_them(tmp_path):
    """rollout.mode: async drives the agentic controller (the next step's collect prefetched while a step
    trains, staleness stamped per trajectory). Partial rollout (over_generate 1.5: 3 groups open for 2)
    leaves a group beyond a step's target in the controller, its prompt already drawn from the cursor:
    the checkpoint saves it and the resumed run trains it, so nothing drawn is lost."""
    import torch

    from unirl.trainer.loop import train

    over = [f"run.output_dir={tmp_path}", *SHORT, "sft.steps=0", "trainer.steps=3", "trainer.prompts_per_step=2",
            "rollout.n=2", "rollout.max_new_tokens=8", "plugins.agentic.over_generate=1.5", "trainer.save_every=2",
            "rollout.mode=async", "rollout.max_staleness=1"]
    config = load_config(ROOT / "recipes" / "agentic-calc-tiny.yaml", over)
    first = Rollouts()
    train(config, load_kernel(extra=[("rollouts", first)]), stop_after=2)
    # step 1's batch was collected in the background during step 0, under the weights before its sync
    assert first.staleness == {0: {0}, 1: {1}}
    state = torch.load(config.run_dir / "checkpoints" / "step_000002" / "extra.pt", weights_only=False)["trainer"]
    carried = state["controller"]
    kept = {g[0].group_id for g in carried["complete"]} | {s.group_id for s in carried["live"]}
    # drive 1 opened 3 groups for 2 (one left over); drive 2 took it and opened 2 more: one is carried
    assert len(kept) == 1 and not kept & (first.groups[0] | first.groups[1])  # launched, not yet trained

    resumed = Rollouts()
    config = load_config(ROOT / "recipes" / "agentic-calc-tiny.yaml", [*over, "run.resume=true"])
    result = train(config, load_kernel(extra=[("rollouts", resumed)]))
    assert result.steps_done == 3
    assert kept < resumed.groups[2]  # the carried group is trained at step 3, beside one fresh group
