"""The demo's pieces: SFT traces built exactly like rollouts, and the driver end to end (short)."""

from __future__ import annotations

from pathlib import Path

import pytest
from unirl_agentic.calls import parse_calls
from unirl_agentic.demo import expression_of, tool_trace

from unirl.api import Sample

ROOT = Path(__file__).resolve().parents[3]


def test_tool_trace_masks_the_tool_turn_and_calls_the_calculator(tok):
    p = Sample(id="p3", prompt_ids=tok.encode("Q: 347*29=? A:"), prompt_text="Q: 347*29=? A:", answer=10063)
    s = tool_trace(p, tok)
    s.validate()
    assert expression_of(p.prompt_text) == "347*29"
    assert [g.kind for g in s.segments] == ["model", "observation", "model"]
    call, obs, answer = (tok.decode(s.response_ids[g.start:g.end]) for g in s.segments)
    (parsed,) = parse_calls(call)
    assert parsed.name == "calculator" and parsed.arguments == {"expression": "347*29"}
    assert obs == "\n<tool_response>10063</tool_response>\n"
    obs_seg = s.segments[1]
    assert set(s.loss_mask[obs_seg.start:obs_seg.end]) == {0}
    assert answer.startswith("10063") and s.response_ids[-1] == tok.eos_token_id


@pytest.mark.slow
def test_demo_driver_runs_sft_and_reports_accuracy_and_turns(tmp_path):
    from unirl_agentic.demo import run_demo

    from unirl.api import load_config

    config = load_config(ROOT / "recipes" / "agentic-calc-tiny.yaml", [
        f"run.output_dir={tmp_path}", "sft.steps=2", "sft.batch_size=8", "data.arith.n_train=64",
        "data.arith.n_eval=4", "trainer.eval_k=2"])
    calls = []
    report = run_demo(config, rl=lambda **parts: calls.append(sorted(parts)), log=lambda _: None)
    assert calls and "engine" in calls[0] and "actor" in calls[0]
    for phase in ("before", "after"):
        r = report[phase]
        assert 0.0 <= r["accuracy"] <= 1.0 and 1.0 <= r["mean_turns"] <= 3.0 and r["failed"] == 0
