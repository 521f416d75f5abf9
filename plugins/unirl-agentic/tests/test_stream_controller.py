"""rollout.mode: stream drives the agentic controller (``concurrent_collects``: the stream driver's
one-group collects take turns on the controller's lock; partial rollout carries a tail across drives).
A short run of the demo recipe with over_generate 1.5 and a sync every step: every step trains whole
groups of rollout.n, each group once, every model token stamped with the version that made it, and a
group's staleness (ledger version minus its oldest token's) within ``max_staleness``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from unirl.api import hookimpl, load_config, load_kernel

ROOT = Path(__file__).resolve().parents[3]


class Trained:
    """Every trained sample's group, staleness and model-token versions, per step (``unirl_on_rollout``)."""

    def __init__(self):
        self.rows: list[tuple[int, int, str, int, list[int]]] = []

    @hookimpl
    def unirl_on_rollout(self, phase, step, version, samples, config):
        if phase == "train":
            for s in samples:
                model = [v for v, m in zip(s.versions, s.loss_mask, strict=True) if m]
                self.rows.append((step, version, s.group_id, s.meta["staleness"], model))


def test_agentic_stream_trains_whole_groups_once_within_the_bound(tmp_path):
    from unirl.api import train

    spy = Trained()
    config = load_config(ROOT / "recipes" / "agentic-calc-tiny.yaml", [
        f"run.output_dir={tmp_path}", "trainer.progress=false", "trainer.plot=false", "trainer.export_hf=false",
        "trainer.steps=3", "trainer.prompts_per_step=2", "rollout.n=2", "trainer.eval_every=0", "sft.steps=0",
        "data.arith.n_train=256", "data.arith.n_eval=4", "trainer.eval_k=2", "rollout.max_new_tokens=8",
        "plugins.agentic.over_generate=1.5", "rollout.mode=stream", "rollout.max_staleness=1"])
    result = train(config, load_kernel(extra=[("trained", spy)]))
    assert result.steps_done == 3
    steps = [h for h in result.history if h.get("step", 0) >= 1]
    assert all("stream/occupancy" in h for h in steps)  # the stream driver ran
    per_step = Counter((step, group) for step, _, group, _, _ in spy.rows)
    assert sorted({step for step, _ in per_step}) == [0, 1, 2]
    assert set(per_step.values()) == {2}  # whole groups of rollout.n
    assert Counter(step for step, _ in per_step) == {0: 2, 1: 2, 2: 2}  # prompts_per_step groups a step
    assert max(Counter(group for _, group in per_step).values()) == 1  # no group trained twice
    for _, version, _, staleness, model in spy.rows:
        assert model and all(1 <= v <= version for v in model)  # every model token stamped, never ahead
        assert staleness == version - min(model) <= 1  # from the oldest token, within the bound
