"""CPU contract tests of the trace: id mapping, units, outcome isolation, dependencies, waits, slots,
barriers, rejections. Hand-built samples with exact times are the oracle; Dynamo runs where a test
needs a replay (it is real and takes milliseconds)."""

from __future__ import annotations

import json

import pytest
from replay_trace_support import T0, agentic_group, build_exporter, config, obs, sample, turn

from unirl.api import UniRLError, load_kernel
from unirl_replay_trace.capture import block_hashes, capture_batch
from unirl_replay_trace.formats import UnsupportedTrace, export
from unirl_replay_trace.replay import compare, occupancy, run

MANIFEST = {"block_size": 16, "model_name": "m"}


def cap(samples, index=0, **kw):
    return capture_batch(samples, index=index, phase="train", step=index, version=1, fingerprint=None,
                         block_size=16, **kw)


def lines(text):
    return [json.loads(x) for x in text.splitlines()]


# ------------------------------------------------------------------ ids, units, isolation


def test_request_ids_map_siblings_turns_and_branches_once():
    b = cap(agentic_group())
    rows = {w["request_id"]: w for w in b.workload}
    g = "p3@train-0"
    # the branch's inherited first turn is the parent's request, not a second copy of it
    assert set(rows) == {f"{g}/0:0", f"{g}/0:1", f"{g}/1:0", f"{g}/0/1:1"}
    assert {w["group_id"] for w in rows.values()} == {g}
    assert rows[f"{g}/0:1"]["parent_request_id"] == f"{g}/0:0"
    assert rows[f"{g}/0/1:1"]["parent_request_id"] == f"{g}/0:0"  # forks from turn 0 of its parent
    assert rows[f"{g}/0/1:1"]["trajectory_id"] == f"{g}/0/1"
    assert [rows[f"{g}/0:{k}"]["turn"] for k in (0, 1)] == [0, 1]
    # lengths: turn 1 conditions on prompt (20) + turn 0 (3) + observation (2)
    assert rows[f"{g}/0:1"]["input_length"] == 25 and rows[f"{g}/0:1"]["output_length"] == 2
    assert not b.problems


def test_timestamps_are_ms_from_the_batch_barrier():
    b = cap(agentic_group())
    out = {o["request_id"]: o for o in b.outcomes if o["kind"] == "request"}
    g = "p3@train-0"
    assert (out[f"{g}/0:0"]["submitted_ms"], out[f"{g}/0:0"]["first_token_ms"], out[f"{g}/0:0"]["finished_ms"]) == (0.0, 5.0, 20.0)
    assert out[f"{g}/0:1"]["submitted_ms"] == 270.0
    barrier = next(o for o in b.outcomes if o["kind"] == "batch")["barrier_unix_ms"]
    assert barrier == T0
    wait = next(w for w in b.workload if w["request_id"] == f"{g}/0:1")["wait_ms"]
    assert wait == 250.0  # ms, not seconds
    dep = next(x for x in lines(export("dynamo-agentic", MANIFEST, b.workload)[0])
               if x.get("request_id") == f"{g}/0:1")["dependencies"][0]
    assert dep == {"request_id": f"{g}/0:0", "trigger": "completion", "delay_ms": 250.0, "relation": "sequence"}


@pytest.mark.parametrize("fmt", ["dynamo-agentic", "mooncake"])
def test_measured_outcomes_never_reach_the_predictor(fmt):
    """Shift every service time: the predictor's input must not change by a byte."""
    a, b = cap(agentic_group(shift=0.0)), cap(agentic_group(shift=37.5))
    assert a.outcomes != b.outcomes
    assert a.workload == b.workload
    keep = [w for w in a.workload if "/0/1" not in w["request_id"]] if fmt == "mooncake" else a.workload
    ea, eb = export(fmt, MANIFEST, keep), export(fmt, MANIFEST, [w for w in b.workload if w in keep])
    assert ea == eb
    measured_keys = {"submitted_ms", "first_token_ms", "finished_ms", "worker", "finish_reason", "timestamp_ms"}
    for x in lines(ea[0]):
        assert not measured_keys & set(x)
        assert x.get("not_before_ms", 0) == 0 and x.get("timestamp", 0) == 0


# ------------------------------------------------------------------ dependencies, waits, slots, barriers


def test_dependencies_point_backwards_inside_one_play():
    b = cap(agentic_group() + agentic_group("p4@train-0"))
    seen, play = set(), {}
    for x in lines(export("dynamo-agentic", MANIFEST, b.workload)[0])[1:]:
        for d in x["dependencies"]:
            assert d["request_id"] in seen and play[d["request_id"]] == x["play_id"]
        seen.add(x["request_id"])
        play[x["request_id"]] = x["play_id"]
    assert len(seen) == 8
    shuffled = list(reversed(b.workload))
    with pytest.raises(UnsupportedTrace, match="not earlier in its batch"):
        export("dynamo-agentic", MANIFEST, shuffled)


def test_zero_wait_and_missing_wait_stay_distinct():
    g = "p5@train-0"
    zero = turn(sample(f"{g}/0"), [3, 4], sub=0, first=1, fin=10)
    obs(zero, [5])
    turn(zero, [6], sub=10, first=11, fin=12)  # submitted the instant the previous turn finished
    missing = turn(sample(f"{g}/1"), [3], sub=0, first=1, fin=None)  # finish never stamped
    turn(missing, [6], sub=30, first=31, fin=40)
    b = cap([zero])
    assert b.workload[1]["wait_ms"] == 0.0
    assert lines(export("dynamo-agentic", MANIFEST, b.workload)[0])[2]["dependencies"][0]["delay_ms"] == 0.0
    assert lines(export("mooncake", MANIFEST, b.workload)[0])[1]["delay"] == 0.0
    m = cap([missing])
    assert m.workload[1]["wait_ms"] is None
    for fmt in ("dynamo-agentic", "mooncake"):
        with pytest.raises(UnsupportedTrace, match="missing wait is not a zero wait"):
            export(fmt, MANIFEST, m.workload)


def test_a_trajectory_in_a_tool_wait_holds_a_slot_but_is_not_in_flight():
    g = "p6@train-0"
    a = turn(sample(f"{g}/0"), [1], sub=0, first=2, fin=10)
    obs(a, [2])
    turn(a, [3], sub=50, first=52, fin=60)  # 40 ms tool wait, while b runs both its turns
    b = turn(sample(f"{g}/1"), [1], sub=20, first=22, fin=30)
    obs(b, [2])
    turn(b, [3], sub=35, first=37, fin=45)
    batch = cap([a, b])
    assert occupancy(batch.workload, batch.outcomes, 0) == {"max_in_flight_requests": 1,
                                                            "max_occupied_trajectory_slots": 2,
                                                            "max_occupied_group_slots": 1}


def test_each_batch_is_its_own_barrier_and_no_request_is_invented():
    b0 = cap(agentic_group("p1@train-0"), index=0)
    late = agentic_group("p2@train-1")
    for s in late:
        for r in s.requests:
            for f in ("submitted_ms", "first_token_ms", "finished_ms"):
                setattr(r, f, getattr(r, f) + 5000.0)
    b1 = cap(late, index=1)
    files = export("dynamo-agentic", MANIFEST, b0.workload + b1.workload)
    assert sorted(files) == [0, 1]
    for b, batch in ((0, b0), (1, b1)):
        reqs = lines(files[b])[1:]
        assert [x["request_id"] for x in reqs] == [w["request_id"] for w in batch.workload]  # no barrier requests
        ids = {x["request_id"] for x in reqs}
        assert all(d["request_id"] in ids for x in reqs for d in x["dependencies"])
        assert all(x["not_before_ms"] == 0 for x in reqs)
    out1 = [o for o in b1.outcomes if o["kind"] == "request"]
    assert min(o["submitted_ms"] for o in out1) == 0.0  # relative to batch 1's own barrier


# ------------------------------------------------------------------ rejections


def _aborted():
    return [turn(sample("p7@train-0/0"), [1, 2], sub=0, first=1, fin=5, reason="abort")]


def _failed():
    return [turn(sample("p7@train-0/0"), [1], sub=0, first=None, fin=None, reason="error")]


def _empty():
    return [turn(sample("p7@train-0/0"), [], sub=0, first=None, fin=3, reason="length")]


def _negative():
    s = turn(sample("p7@train-0/0"), [1], sub=0, first=1, fin=10)
    obs(s, [2])
    return [turn(s, [3], sub=5, first=11, fin=12)]


def _orphan_branch():
    s = turn(sample("p7@train-0/0/1"), [1], sub=0, first=1, fin=2)
    return [s]


def _rejected_parent():
    parent = _record_mismatch()[0]
    branch = parent.copy()
    branch.id = f"{parent.id}/1"
    return [parent, branch]


def _carried():
    s = turn(sample("p7@train-0/0"), [1], sub=0, first=1, fin=2, version=1)
    obs(s, [2])
    return [turn(s, [3], sub=5, first=6, fin=7, version=2)]


def _record_mismatch():
    s = turn(sample("p7@train-0/0"), [1], sub=0, first=1, fin=2)
    s.requests.append(s.requests[0])
    return [s]


@pytest.mark.parametrize("make, fmt, match", [
    (_aborted, "dynamo-agentic", "aborted"),
    (_failed, "dynamo-agentic", "no measured submit / finish"),
    (_empty, "mooncake", "generated no tokens"),
    (_negative, "dynamo-agentic", "negative wait"),
    (_orphan_branch, "dynamo-agentic", "not in the same rollout batch"),
    (_record_mismatch, "mooncake", "request records for 1 model turns"),
    (_carried, "dynamo-agentic", "spans weight versions"),
    (_rejected_parent, "dynamo-agentic", "could not be mapped"),
    (agentic_group, "mooncake", "branch"),
    (agentic_group, "sharegpt", "unknown"),
])
def test_every_unsupported_case_is_rejected(make, fmt, match):
    b = cap(make())
    with pytest.raises(UnsupportedTrace, match=match):
        export(fmt, MANIFEST, b.workload, b.problems)


def test_rejected_trace_keeps_what_was_captured(tmp_path):
    ex = build_exporter(config(tmp_path, "mooncake"))
    ex.record(phase="train", step=0, version=1, samples=agentic_group())
    trace = ex.close()  # never raises: the trainer also calls it while a crash propagates
    doc = json.loads((tmp_path / "r" / "trace" / "manifest.json").read_text())
    assert "branch" in doc["rejected"]
    assert not (tmp_path / "r" / "trace" / "mooncake").exists()  # no replay file, nothing approximated
    assert len((tmp_path / "r" / "trace" / "workload.jsonl").read_text().splitlines()) == 4
    with pytest.raises(UniRLError, match="rejected at export"):
        run(trace)


# ------------------------------------------------------------------ hashes, content, plumbing


def test_block_hashes_are_chained_prefix_hashes():
    a, b = list(range(40)), list(range(32)) + [99] * 8
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ha) == 3  # a partial last block is hashed too (replay needs input <= blocks * size)
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    assert block_hashes([7] + a[1:], 16)[1] != ha[1]  # a change in block 0 changes every later hash
    assert all(0 <= h < 2**62 for h in ha)


def test_raw_content_is_excluded_by_default(tmp_path):
    for opt, name in ((False, "off"), (True, "on")):
        d = tmp_path / name
        ex = build_exporter(config(d, include_content=opt))
        s = turn(sample("p8@train-0/0", text="SECRET prompt"), [5], sub=0, first=1, fin=2)
        s.response_text = "SECRET answer"
        ex.record(phase="train", step=0, version=1, samples=[s])
        trace = ex.close()
        blob = "".join(p.read_text() for p in (d / "r" / "trace").rglob("*") if p.is_file())
        assert ("SECRET" in blob) is opt
        assert json.loads((d / "r" / "trace" / "manifest.json").read_text())["content_included"] is opt
        assert trace == str(d / "r" / "trace")


def test_group_completion_and_batch_readiness_are_distinct():
    samples = agentic_group("p1@train-0") + [turn(sample("p2@train-0/0"), [1], sub=0, first=1, fin=500)]
    b = cap(samples)
    pred = {0: {"per_request": [{"request_id": w["request_id"], "arrival_time_ms": 0.0, "ttft_ms": 1.0,
                                 "e2e_latency_ms": 2.0, "terminal_time_ms": 10.0 * (i + 1)}
                                for i, w in enumerate(b.workload)]}}
    rep = compare(b.workload, b.outcomes, pred, "dynamo-agentic")
    groups = {g["group_id"]: g for g in rep["group_completion"]}
    assert groups["p1@train-0"]["measured_ms"] == 290.0 and groups["p2@train-0"]["measured_ms"] == 500.0
    # workload order: p1/0:0, p1/0:1, p1/1:0, p2/0:0, then the branch p1/0/1:1 (terminals 10..50)
    assert groups["p1@train-0"]["predicted_ms"] == 50.0 and groups["p2@train-0"]["predicted_ms"] == 40.0
    assert rep["batch_readiness"] == [{"batch": 0, "measured_ms": 500.0, "predicted_ms": 50.0}]
    with pytest.raises(Exception, match="no result for 1 request"):
        compare(b.workload, b.outcomes, {0: {"per_request": pred[0]["per_request"][:-1]}}, "dynamo-agentic")


def test_plugin_registers_exporters_and_the_trace_command():
    kernel = load_kernel()
    assert {"dynamo-agentic", "mooncake"} <= set(kernel.registries["trace_exporters"])
    assert "trace" in kernel.registries["commands"]


# ------------------------------------------------------------------ replay with real Dynamo (ms each)


def _trace(tmp_path, batches=1, exporter="dynamo-agentic"):
    ex = build_exporter(config(tmp_path)) if exporter == "dynamo-agentic" else \
        build_exporter(config(tmp_path, "mooncake"))
    for i in range(batches):
        group = agentic_group(f"p{i}@train-{i}") if exporter == "dynamo-agentic" else \
            [s for s in agentic_group(f"p{i}@train-{i}") if s.depth == 1]
        ex.record(phase="train", step=i, version=1, samples=group)
    return ex.close()


def test_mooncake_replay_is_aggregate_only(tmp_path):
    rep = run(_trace(tmp_path, exporter="mooncake"))
    assert rep["mode"] == "aggregate-only" and rep["per_request"] == [] and rep["group_completion"] == []
    assert rep["aggregate"]["group_completion"]["n"] == 0
    assert "uncalibrated" in rep["timing_model"] and "NOT calibrated" in rep["note"]


def test_calibration_and_holdout_batches_stay_separate(tmp_path):
    rep = run(_trace(tmp_path, batches=4), fit={"speedup_ratio": [0.5, 1.0, 4.0]})
    cal = rep["calibration"]
    assert cal["calibration_batches"] == [0, 1] and cal["holdout_batches"] == [2, 3]
    best = min(cal["candidates"], key=lambda c: c["calibration_error"])
    assert cal["chosen"] == best["params"]
    assert {r["batch"] for r in rep["per_request"]} == {2, 3}  # rows are held-out only
    assert "fitted on calibration batches [0, 1]" in rep["timing_model"]


def test_cli_writes_report_and_png(tmp_path, capsys):
    from unirl.cli import main

    trace = _trace(tmp_path)
    assert main(["trace", "replay", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "per-request" in out and "NOT calibrated" in out
    doc = json.loads((tmp_path / "r" / "trace" / "report.json").read_text())
    assert doc["requests"] == 4
    assert (tmp_path / "r" / "trace" / "replay.png").read_bytes()[:4] == b"\x89PNG"
    assert trace.endswith("trace")


def test_fingerprints_come_from_agreeing_receipts_only(tmp_path):
    from unirl.api import Receipt
    from unirl_replay_trace.plugin import unirl_on_weights_published

    cfg = config(tmp_path)
    window = {"started_ms": 1.0, "ended_ms": 2.0}
    unirl_on_weights_published(version=1, receipts=[Receipt(0, 1, "a" * 64), Receipt(1, 1, "a" * 64)], config=cfg,
                               **window)
    unirl_on_weights_published(version=2, receipts=[Receipt(0, 2, "b" * 64), Receipt(1, 2, "c" * 64)], config=cfg,
                               **window)
    ex = build_exporter(cfg)
    for v in (0, 1, 2):
        ex.record(phase="train", step=v, version=v, samples=[turn(sample(f"p{v}@train-{v}/0"), [1], sub=0, first=1, fin=2)])
    assert [b["fingerprint"] for b in ex.manifest()["batches"]] == [None, "a" * 64, None]


def test_lanes_hold_a_whole_group_through_its_tool_waits(tmp_path):
    """``--lanes 1``: Dynamo runs one group (play) at a time, the 250 ms tool wait included."""
    ex = build_exporter(config(tmp_path))
    ex.record(phase="train", step=0, version=1, samples=agentic_group("p1@train-0") + agentic_group("p2@train-0"))
    trace = ex.close()
    for lanes, serial in ((None, False), (1, True)):
        rows = run(trace, lanes=lanes)["per_request"]
        span = {g: (min(r["predicted"]["arrival"] for r in rows if r["group_id"] == g),
                    max(r["predicted"]["terminal"] for r in rows if r["group_id"] == g)) for g in ("p1@train-0", "p2@train-0")}
        (a0, a1), (b0, b1) = sorted(span.values())
        assert (b0 >= a1) is serial


def test_bad_input_is_named_before_any_replay(tmp_path):
    from unirl.api import ConfigError
    from unirl_replay_trace.replay import parse_fit

    with pytest.raises(ConfigError, match="no trace here"):
        run(tmp_path)
    with pytest.raises(ConfigError, match="KEY=V1,V2"):
        parse_fit(["speedup_ratio"])
    with pytest.raises(ConfigError, match="at least 2 rollout batches"):
        run(_trace(tmp_path), fit={"speedup_ratio": [1.0]})
    assert parse_fit(["speedup_ratio=0.5,2"]) == {"speedup_ratio": [0.5, 2]}
