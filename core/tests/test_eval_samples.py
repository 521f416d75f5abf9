"""``unirl eval``'s per-prompt JSONL carries each completion whole (``samples``: its Parts and path id),
and the rows rebuild the Samples the eval scored. Oracle: the samples the eval controller handed the
trainer's ``unirl_on_rollout`` hook, captured in memory."""

from __future__ import annotations

import json
from pathlib import Path

from unirl.api import hookimpl, load_config, load_kernel, sample_from_row
from unirl.evaluation import evaluate_model

ROOT = Path(__file__).resolve().parents[2]


class Seen:
    def __init__(self):
        self.samples = []

    @hookimpl
    def unirl_on_rollout(self, phase, step, version, samples, config):
        self.samples.extend(s.copy() for s in samples)


def test_eval_rows_carry_each_completion_as_a_sample(tmp_path):
    cfg = load_config(ROOT / "recipes" / "arith-tiny.yaml", [
        f"run.output_dir={tmp_path}", "data.arith.n_eval=3", "rollout.max_new_tokens=4", "trainer.progress=false",
        "model.build={hidden_size: 64, intermediate_size: 128}"])
    seen = Seen()
    out = tmp_path / "ev.jsonl"
    evaluate_model(cfg, load_kernel(extra=[("seen", seen)]), k=2, out=out)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    by_id = {s.id: s for s in seen.samples}
    assert len(rows) == 3 and len(by_id) == 6
    for r in rows:
        assert [x["response_text"] for x in r["samples"]] == r["completions"]
        for x in r["samples"]:
            got, want = sample_from_row(x), by_id[x["sample_id"]]
            assert got.parts == want.parts and got.response_ids == want.response_ids
            assert got.rollout_logprobs == want.rollout_logprobs and got.loss_mask == want.loss_mask
            assert got.reward == want.reward and got.prompt_id == r["prompt_id"]
