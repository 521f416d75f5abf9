"""Issue 36 item 6: traces carry the Sample tree (Parts with roles and turns, the fork path).

Oracles: the in-memory Samples themselves (``content.jsonl`` read back must rebuild them, Part for Part
and list for list, with their fork path), hand-built request times (a fork's shared turns are one
request, each branch depends on it), a real Dynamo replay of the fork trace (every request joined), and
a trace written in the schema-2 layout (it still replays, and its text-only content still reads).
"""

from __future__ import annotations

import json
import math

import pytest
from replay_trace_support import agentic_group, build_exporter, config, obs, sample, turn

from unirl.api import Part, Sample, fork_point
from unirl_replay_trace.capture import capture_batch
from unirl_replay_trace.content import content_row, read_rows, read_samples, sample_of
from unirl_replay_trace.replay import run


def fork_tree(gid: str = "p5@train-0") -> list[Sample]:
    """What ``rollout.branching: {at_turns: [1, 2], n: 2}`` leaves in a batch: trajectory ``/0`` ran turn 0
    and got its tool result, then forked into ``/0/f1.0`` and ``/0/f1.1`` (the parent is gone); branch
    ``f1.0`` forked again before its turn 2 (``/0/f1.0/f2.0``, ``/0/f1.0/f2.1``). Sibling ``/1`` answered at
    once (no fork). A tool-call Part and a payload ride along (non-text roles survive the round trip)."""
    root = turn(sample(f"{gid}/0", text="what is 6*7?"), [30, 31, 32], sub=0, first=5, fin=20)
    root.append_part(Part("observation", [40, 41], turn=0, payload={"tool": "calculator", "ms": 3.5}))
    a, b = root.fork(0), root.fork(1)
    turn(a, [33], sub=40, first=44, fin=46)
    obs(a, [42])
    turn(b, [34, 35], sub=40, first=45, fin=50, reason="length")
    aa, ab = a.fork(0), a.fork(1)
    turn(aa, [36], sub=70, first=72, fin=74)
    turn(ab, [37, 38], sub=70, first=73, fin=76)
    other = turn(sample(f"{gid}/1"), [39], sub=0, first=4, fin=9)
    for s, r in zip((b, aa, ab, other), (1.0, 0.0, 1.0, 0.0), strict=True):
        s.reward = r
        s.response_text = f"text of {s.id}"
    return [b, aa, ab, other]


def test_a_fork_tree_is_captured_with_shared_turns_once_and_the_fork_path():
    samples = fork_tree()
    batch = capture_batch(samples, index=0, phase="train", step=0, version=1, fingerprint=None, block_size=16)
    assert not batch.problems
    rows = {w["request_id"]: w for w in batch.workload}
    g = "p5@train-0"
    # the parent's turn 0 once (its trajectory was replaced by the branches), each branch's own turns
    assert set(rows) == {f"{g}/0:0", f"{g}/0/f1.0:1", f"{g}/0/f1.1:1", f"{g}/0/f1.0/f2.0:2",
                         f"{g}/0/f1.0/f2.1:2", f"{g}/1:0"}
    assert rows[f"{g}/0/f1.1:1"]["parent_request_id"] == f"{g}/0:0"
    assert rows[f"{g}/0/f1.0/f2.1:2"]["parent_request_id"] == f"{g}/0/f1.0:1"
    assert rows[f"{g}/0/f1.0/f2.1:2"]["fork"] == {"parent": f"{g}/0/f1.0", "at_turn": 2, "branch": 1}
    assert rows[f"{g}/0:0"]["fork"] is None and rows[f"{g}/1:0"]["fork"] is None
    assert rows[f"{g}/0/f1.1:1"]["wait_ms"] == 20.0  # from the parent's turn 0 finishing to the branch's submit
    # before turn 2: the prompt (20), turn 0 (3), its observation (2), turn 1 of f1.0 (1), its observation (1)
    assert rows[f"{g}/0/f1.0/f2.0:2"]["input_length"] == 20 + 3 + 2 + 1 + 1


def test_content_rows_rebuild_every_sample_with_its_parts_and_fork_path(tmp_path):
    samples = fork_tree()
    ex = build_exporter(config(tmp_path, include_content=True))
    ex.record(phase="train", step=0, version=1, samples=samples)
    trace = ex.close()
    manifest = json.loads((tmp_path / "r" / "trace" / "manifest.json").read_text())
    assert manifest["schema_version"] == 3 and "rejected" not in manifest
    back = read_samples(trace)
    assert [s.id for s in back] == sorted((s.id for s in samples), key=lambda i: (i.count("/"), i))
    by_id = {s.id: s for s in samples}
    for got in back:
        want = by_id[got.id]
        assert got.parts == want.parts  # roles, turns, tokens, log-probs, versions, payloads
        assert got == Sample.from_parts(want.id, want.parts, prompt_text=want.prompt_text,
                                        response_text=want.response_text, status=want.status,
                                        finish_reason=want.finish_reason, reward=want.reward, seed=want.seed)
        for f in ("response_ids", "loss_mask", "rollout_logprobs", "versions", "spans", "status", "finish_reason"):
            assert getattr(got, f) == getattr(want, f), (got.id, f)
        assert fork_point(got.id) == fork_point(want.id) and got.fork_group_id == want.fork_group_id
        assert [t.index for t in got.turn_list()] == [t.index for t in want.turn_list()]
    rows = {r["sample_id"]: r for r in read_rows(trace)}
    assert rows["p5@train-0/0/f1.0/f2.1"]["fork"] == {"parent": "p5@train-0/0/f1.0", "at_turn": 2, "branch": 1}
    assert rows["p5@train-0/0/f1.1"]["parts"][2]["payload"] == {"tool": "calculator", "ms": 3.5}
    # a failed sample's NaN reward survives as NaN (JSON has no NaN: written null)
    s = turn(sample("p6@train-0/0"), [1], sub=0, first=1, fin=2)
    s.mark_failed("tool timed out")
    assert math.isnan(sample_of(json.loads(json.dumps(content_row(s)))).reward)


def test_the_fork_trace_replays_on_dynamo_request_for_request(tmp_path):
    ex = build_exporter(config(tmp_path))
    ex.record(phase="train", step=0, version=1, samples=fork_tree())
    rep = run(ex.close())
    got = {r["request_id"] for r in rep["per_request"]}
    assert len(got) == 6 and "p5@train-0/0:0" in got and "p5@train-0/0/f1.0/f2.1:2" in got


def test_a_schema_2_trace_still_replays_and_its_text_content_still_reads(tmp_path):
    """The layout written before the Parts: no ``fork`` in the workload, text-only content rows."""
    ex = build_exporter(config(tmp_path, include_content=True))
    ex.record(phase="train", step=0, version=1, samples=agentic_group("p1@train-0"))
    trace = ex.close()
    d = tmp_path / "r" / "trace"
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["schema_version"] = 2
    (d / "manifest.json").write_text(json.dumps(manifest))
    rows = [json.loads(x) for x in (d / "workload.jsonl").read_text().splitlines()]
    (d / "workload.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "fork"}) + "\n"
                                              for r in rows))
    old = [{k: r[k] for k in ("sample_id", "prompt_text", "response_text")} for r in read_rows(trace)]
    (d / "content.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    assert len(run(trace)["per_request"]) == 4
    assert [r["sample_id"] for r in read_rows(trace)] == [r["sample_id"] for r in old]
    with pytest.raises(ValueError, match="no .parts.*text only.*schema 3.*include_content"):
        read_samples(trace)


def test_branches_the_embedded_engine_generated_are_captured_and_rebuilt(tmp_path):
    """The same on real records: the embedded engine serves a trajectory's turn 0, then the 3 branches
    of a fork before turn 1 (one submission: the shared context is prefilled once)."""
    from unirl.api import Qwen3Adapter, RunConfig, SamplingParams, build_demo_tokenizer, build_engine

    tok = build_demo_tokenizer()
    eng = build_engine(RunConfig(), adapter=Qwen3Adapter(), tokenizer=tok)
    try:
        parent = Sample(id="p1@train0.0/0", prompt_ids=tok.encode("3*4=", add_special_tokens=False), seed=3)
        eng.generate([parent], SamplingParams(max_new_tokens=4))
        parent.append_observation(tok.encode("<r>12</r>", add_special_tokens=False), text="<r>12</r>")
        branches = [parent.fork(b) for b in range(3)]
        eng.generate(branches, SamplingParams(max_new_tokens=4))
    finally:
        eng.close()
    for b in branches:
        b.reward = 0.0
    ex = build_exporter(config(tmp_path, include_content=True))
    ex.record(phase="train", step=0, version=1, samples=branches)
    trace = ex.close()
    manifest = json.loads((tmp_path / "r" / "trace" / "manifest.json").read_text())
    assert "rejected" not in manifest, manifest.get("rejected")
    work = [json.loads(x) for x in (tmp_path / "r" / "trace" / "workload.jsonl").read_text().splitlines()]
    assert [w["request_id"] for w in work] == ["p1@train0.0/0:0"] + [f"p1@train0.0/0/f1.{b}:1" for b in range(3)]
    assert all(w["parent_request_id"] == "p1@train0.0/0:0" for w in work[1:])
    outcomes = [json.loads(x) for x in (tmp_path / "r" / "trace" / "outcomes.jsonl").read_text().splitlines()]
    cached = sorted(o["cached_tokens"] for o in outcomes if o["kind"] == "request" and o["request_id"] != work[0]["request_id"])
    assert cached[0] == 0 and cached[1] == cached[2] == work[1]["input_length"]  # one branch prefilled for all
    for got, want in zip(read_samples(trace), branches, strict=True):
        assert got.id == want.id and got.parts == want.parts and got.response_ids == want.response_ids
        assert got.rollout_logprobs == want.rollout_logprobs and got.versions == want.versions
