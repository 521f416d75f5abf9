"""Async and stream runs export as one arrival stream with weight syncs as pauses (issue 73 item 3):
hand-built batches with exact times, so each expected number is written down from the inputs."""

from __future__ import annotations

import json

import pytest
from replay_trace_support import T0, agentic_group, build_exporter, config, sample, turn

from unirl.api import Receipt
from unirl_replay_trace.formats import UnsupportedTrace, export
from unirl_replay_trace.plugin import unirl_on_weights_published
from unirl_replay_trace.replay import load, render, run
from unirl_replay_trace.stream_trace import held


def _async_trace(tmp_path, mode="async"):
    """Batch 0 submits at T0; a sync runs T0+100..T0+180; batch 1's first sibling was submitted at
    T0+50 (before it, overlapping batch 0), its second at T0+120 (inside it: held to its end)."""
    cfg = config(tmp_path)
    cfg.rollout.mode = mode
    unirl_on_weights_published(version=1, receipts=[Receipt(0, 1, "a" * 64)], config=cfg,
                               started_ms=T0 + 100.0, ended_ms=T0 + 180.0)
    ex = build_exporter(cfg)
    ex.record(phase="train", step=0, version=0, samples=agentic_group("p1@train-0"))
    late = [turn(sample("p2@train-1/0"), [50, 51], sub=50, first=60, fin=90),
            turn(sample("p2@train-1/1"), [52], sub=120.25, first=190, fin=200)]
    ex.record(phase="train", step=1, version=1, samples=late)
    return cfg, ex.close()


def test_async_trace_is_one_stream_with_the_sync_as_a_pause(tmp_path):
    _, trace = _async_trace(tmp_path)
    manifest = json.loads((tmp_path / "r" / "trace" / "manifest.json").read_text())
    assert "rejected" not in manifest
    st = manifest["stream"]
    assert st["origin_unix_ms"] == T0 and st["batch_offsets_ms"] == {"0": 0.0, "1": 50.0}
    assert st["syncs"] == [{"version": 1, "start_ms": 100.0, "end_ms": 180.0}]
    files = sorted(p.name for p in (tmp_path / "r" / "trace" / "dynamo-agentic").iterdir())
    assert files == ["batch-0000.jsonl"]  # one replay unit: the whole run
    lines = [json.loads(x) for x in (tmp_path / "r" / "trace" / "dynamo-agentic" / "batch-0000.jsonl").open()][1:]
    arrive = {x["request_id"]: x["not_before_ms"] for x in lines if not x["dependencies"]}
    # batch 0's first turns at 0; batch 1's at its observed submits on the run's clock, one held past the sync
    assert arrive == {"p1@train-0/0:0": 0.0, "p1@train-0/1:0": 0.0, "p2@train-1/0:0": 50.0, "p2@train-1/1:0": 180.0}
    deps = {x["request_id"]: x["dependencies"][0]["delay_ms"] for x in lines if x["dependencies"]}
    assert deps == {"p1@train-0/0:1": 250.0, "p1@train-0/0/1:1": 0.0}  # turns keep their measured waits


def test_stream_trace_replays_in_dynamo_and_joins_on_the_run_clock(tmp_path):
    _, trace = _async_trace(tmp_path, mode="stream")
    _, manifest, workload, outcomes = load(trace)
    assert [b["batch"] for b in manifest["batches"]] == [0] and manifest["batches"][0]["requests"] == 6
    measured = {o["request_id"]: o for o in outcomes if o["kind"] == "request"}
    assert measured["p2@train-1/1:0"]["submitted_ms"] == 120.25  # measured times are shifted, never held
    assert measured["p2@train-1/1:0"]["finished_ms"] == 200.0 and measured["p1@train-0/0:1"]["finished_ms"] == 290.0
    rep = run(trace)
    assert rep["requests"] == 6 and len(rep["batch_readiness"]) == 1
    assert rep["batch_readiness"][0]["measured_ms"] == 290.0  # the run's makespan from its first submit
    pred = {r["request_id"]: r["predicted"] for r in rep["per_request"]}
    assert pred["p2@train-1/1:0"]["arrival"] == pytest.approx(180.0)  # the mocker saw the pause
    assert pred["p2@train-1/0:0"]["arrival"] == pytest.approx(50.0)
    whole = rep["stream"]  # the run as a whole, per captured batch: span from its first arrival to its last finish
    assert (whole["mode"], whole["syncs"], whole["pause_ms_total"], whole["held_arrivals"]) == ("stream", 1, 80.0, 1)
    spans = {b["captured_batch"]: (b["measured_ready_ms"], b["measured_span_ms"]) for b in whole["captured_batches"]}
    assert spans == {0: (290.0, 290.0), 1: (200.0, 150.0)}
    assert all(b["predicted_span_ms"] > 0 for b in whole["captured_batches"])
    text = render(rep)
    assert "stream (stream): one arrival stream; 1 sync(s), 80.0 ms paused, 1 arrival(s) held" in text
    assert "captured batch 1: span measured 150.0 ms" in text


def test_barrier_arrivals_are_refused_for_a_stream(tmp_path):
    _, trace = _async_trace(tmp_path)
    _, manifest, workload, _ = load(trace)
    with pytest.raises(UnsupportedTrace, match="no batch barrier"):
        export("dynamo-agentic", manifest, workload, arrivals="barrier")


def test_held_moves_only_arrivals_strictly_inside_a_window():
    syncs = [{"start_ms": 10.0, "end_ms": 20.0}, {"start_ms": 30.0, "end_ms": 35.5}]
    assert [held(t, syncs) for t in (9.999, 10.0, 10.001, 19.0, 20.0, 31.0, 40.0)] == \
        [9.999, 10.0, 20.0, 20.0, 20.0, 35.5, 40.0]


def test_a_sync_trace_has_no_stream(tmp_path):
    ex = build_exporter(config(tmp_path))
    ex.record(phase="train", step=0, version=1, samples=agentic_group())
    ex.close()
    assert "stream" not in json.loads((tmp_path / "r" / "trace" / "manifest.json").read_text())
