"""``unirl.sample_rows``: a Sample as one JSON object and back. Oracle: the in-memory Sample (every field a
row carries equal after ``json.dumps`` / ``json.loads``), including a fork branch's path, a non-text
payload, a tool-call Part and a failed sample's NaN reward."""

from __future__ import annotations

import json
import math

import pytest

from unirl.api import Part, Sample, SampleError, sample_from_row, sample_row


def _tree() -> list[Sample]:
    s = Sample(id="p2@train0.0/1", prompt_ids=[5, 6, 7], prompt_text="2+2?", seed=9)
    s.append_part(Part("tool_call", [11, 12], [-0.25, -1.5], 3, 0))
    s.append_part(Part("observation", [13], turn=0, payload={"tool": "calculator", "ms": 2.5}))
    a = s.fork(0)
    a.append_model_turn([14, 15], [-0.125, -3.0e-7], 4, "stop", text="4")
    a.reward = 1.0
    b = s.fork(1)
    b.append_part(Part("image", [], turn=0, payload=object()))  # JSON cannot hold it: dropped, named
    b.append_model_turn([16], [-2.0], 4, "length")
    b.mark_failed("tool timed out")
    return [a, b]


def test_a_row_rebuilds_the_sample_with_its_parts_and_fork_path():
    a, b = _tree()
    back = sample_from_row(json.loads(json.dumps(sample_row(a))))
    assert back == Sample.from_parts(a.id, a.parts, prompt_text=a.prompt_text, response_text=a.response_text,
                                     status=a.status, finish_reason=a.finish_reason, reward=a.reward, seed=a.seed)
    assert back.parts == a.parts and back.spans == a.spans and back.turn_list() == a.turn_list()
    for f in ("id", "prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "versions", "reward", "seed"):
        assert getattr(back, f) == getattr(a, f), f
    row = sample_row(a)
    assert row["fork"] == {"parent": "p2@train0.0/1", "at_turn": 1, "branch": 0} and row["group_id"] == "p2@train0.0"
    assert [p["role"] for p in row["parts"]] == ["prompt", "tool_call", "observation", "model"]

    row_b = json.loads(json.dumps(sample_row(b)))
    assert row_b["reward"] is None and row_b["parts"][3]["payload_dropped"] == "object"
    back_b = sample_from_row(row_b)
    assert math.isnan(back_b.reward) and back_b.status == "failed" and back_b.response_ids == b.response_ids
    assert back_b.parts[3].payload is None and back_b.parts[2].payload == {"tool": "calculator", "ms": 2.5}


def test_a_text_only_row_is_refused_by_name():
    with pytest.raises(SampleError, match="p1@t/0.*no 'parts'"):
        sample_from_row({"sample_id": "p1@t/0", "prompt_text": "x", "response_text": "y"})
