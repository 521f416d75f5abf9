"""Trace fidelity (issue 37): observed arrivals, initial cache state, the tool / overhead split of waits,
the Dynamo version check, and calibration on held-out batches. Hand-built samples with exact times are
the oracle; Dynamo is real (1.6.1) and replays these in milliseconds."""

from __future__ import annotations

import json

import pytest
from replay_trace_support import agentic_group, build_exporter, config, obs, sample, turn

from unirl_replay_trace import replay as replay_mod
from unirl_replay_trace.capture import capture_batch
from unirl_replay_trace.formats import DYNAMO_VALIDATED, export
from unirl_replay_trace.replay import DynamoVersionSkew, run

MANIFEST = {"block_size": 16, "model_name": "m"}


def cap(samples, index=0):
    return capture_batch(samples, index=index, phase="train", step=index, version=1, fingerprint=None, block_size=16)


def lines(text):
    return [json.loads(x) for x in text.splitlines()]


def staggered():
    """Two trajectories of one group: the second submitted 100 ms after the barrier (observed arrival)."""
    a = turn(sample("p1@train-0/0"), [5, 6, 7], sub=0, first=3, fin=9)
    b = turn(sample("p1@train-0/1", prompt=list(range(30, 50))), [8, 9], sub=100, first=104, fin=110)
    return [a, b]


def write_trace(tmp_path, batches):
    exp = build_exporter(config(tmp_path))
    for i, samples in enumerate(batches):
        exp.record(phase="train", step=i, version=1, samples=samples)
    return exp.close()


def test_first_turns_carry_their_observed_arrival_and_barrier_mode_is_an_option(tmp_path):
    b = cap(staggered())
    arrivals = {w["request_id"]: w["arrival_ms"] for w in b.workload}
    assert arrivals == {"p1@train-0/0:0": 0.0, "p1@train-0/1:0": 100.0}
    observed = {x["request_id"]: x["not_before_ms"] for x in lines(export("dynamo-agentic", MANIFEST, b.workload)[0])[1:]}
    barrier = {x["request_id"]: x["not_before_ms"]
               for x in lines(export("dynamo-agentic", MANIFEST, b.workload, arrivals="barrier")[0])[1:]}
    assert observed == arrivals and set(barrier.values()) == {0}
    # a child turn gets no arrival of its own (it depends on measured service): only its dependency
    g = agentic_group()
    child = next(w for w in cap(g).workload if w["request_id"] == "p3@train-0/0:1")
    assert child["arrival_ms"] is None
    # real Dynamo schedules the late trajectory at its observed arrival, or at the barrier on request
    trace = write_trace(tmp_path, [staggered()])
    for mode, expect in (("observed", 100.0), ("barrier", 0.0)):
        rep = run(trace, arrivals=mode)
        late = next(r for r in rep["per_request"] if r["request_id"] == "p1@train-0/1:0")
        assert late["predicted"]["arrival"] == pytest.approx(expect, abs=1.0), (mode, late)
        assert rep["arrivals"] == mode


def test_initial_cache_state_and_the_tool_overhead_split_of_waits(tmp_path):
    g = "p2@train-0"
    a = turn(sample(f"{g}/0"), [1, 2], sub=0, first=2, fin=10)
    a.requests[0].cache_tokens_at_submit = 0
    a.append_observation([3, 4], tool_ms=180.0)  # the tool took 180 ms of the 250 ms gap
    turn(a, [5], sub=260, first=262, fin=270)
    b = cap([a])
    row = next(w for w in b.workload if w["turn"] == 1)
    assert (row["wait_ms"], row["tool_ms"], row["overhead_ms"]) == (250.0, 180.0, 70.0)
    assert b.meta()["initial_cache"] == {"state": "empty", "prefix_tokens": 0, "engine": "torch"}
    # the replay's delay is the whole wait: tool time and overhead are both time the engine did not serve
    dep = lines(export("dynamo-agentic", MANIFEST, b.workload)[0])[2]["dependencies"][0]
    assert dep["delay_ms"] == 250.0
    # no tool time measured: the split is unknown, never guessed
    c = turn(sample(f"{g}/1"), [1], sub=0, first=1, fin=5)
    obs(c, [2])
    turn(c, [3], sub=15, first=16, fin=20)
    assert next(w for w in cap([c]).workload if w["turn"] == 1)["tool_ms"] is None
    # warm: the engine's cache held tokens at the batch's first submit; unknown when it cannot say
    warm = turn(sample("p3@train-1/0"), [1], sub=0, first=1, fin=5)
    warm.requests[0].cache_tokens_at_submit = 96
    assert cap([warm]).meta()["initial_cache"]["state"] == "warm"
    assert cap([turn(sample("p4@train-1/0"), [1], sub=0, first=1, fin=5)]).meta()["initial_cache"]["state"] == "unknown"
    rep = run(write_trace(tmp_path, [[a], [warm]]))
    assert [c["cold_start_mismatch"] for c in rep["initial_cache"]] == [False, True]
    assert rep["waits"][0]["tool_ms_total"] == 180.0 and rep["waits"][0]["overhead_ms_total"] == 70.0


def test_a_dynamo_version_mismatch_is_an_error_or_with_allow_skew_a_warning(tmp_path, monkeypatch, capsys):
    trace = write_trace(tmp_path, [agentic_group()])
    manifest = json.loads((tmp_path / "r" / "trace" / "manifest.json").read_text())
    assert manifest["dynamo"]["validated"] == DYNAMO_VALIDATED
    assert run(trace)["dynamo"]["version_skew"] is None  # the installed Dynamo is the validated one
    monkeypatch.setattr(replay_mod, "installed_dynamo", lambda: {"ai-dynamo": "1.7.0", "ai-dynamo-runtime": "1.7.0"})
    with pytest.raises(DynamoVersionSkew) as info:
        run(trace)
    msg = str(info.value)
    assert "ai-dynamo 1.7.0" in msg and DYNAMO_VALIDATED in msg and "--allow-version-skew" in msg
    assert f"pip install ai-dynamo-runtime=={DYNAMO_VALIDATED}" in msg
    from unirl_replay_trace.cli import main

    with pytest.raises(DynamoVersionSkew):  # checked before any replay or output file
        main(["replay", trace])
    assert not (tmp_path / "r" / "trace" / "report.json").exists()
    assert main(["replay", trace, "--allow-version-skew"]) == 0
    report = json.loads((tmp_path / "r" / "trace" / "report.json").read_text())
    assert "1.7.0" in report["dynamo"]["version_skew"]
    assert "WARNING (--allow-version-skew)" in capsys.readouterr().out


@pytest.mark.slow  # ~70 grid points x 2 fitting batches of real replays, plus the engine: about a minute
def test_calibrate_fits_on_half_the_batches_and_reports_held_out_error(tmp_path, capsys):
    """Four batches of the real embedded engine: the fit reads batches 0 and 2 only, the error is
    measured on 1 and 3; afterwards `unirl trace replay` uses the fit and stops saying uncalibrated."""
    from unirl.api import (
        Qwen3Adapter,
        RunConfig,
        Sample,
        SamplingParams,
        build_demo_tokenizer,
        build_engine,
        expand,
    )
    from unirl_replay_trace.cli import main

    cfg = config(tmp_path)
    engine = build_engine(RunConfig(rollout={"options": {"batch_size": 8}}), adapter=Qwen3Adapter(),
                          tokenizer=build_demo_tokenizer())
    exp = build_exporter(cfg)
    try:
        for i in range(4):
            roots = [Sample(id=f"q{j}", prompt_ids=[2, 10 + j, 20 + i, 30 + j]) for j in range(6)]
            samples = engine.generate(expand(roots, 4, tag=f"train-{i}", base_seed=i),
                                      SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=()))
            exp.record(phase="train", step=i, version=0, samples=samples)
    finally:
        engine.close()
    trace = exp.close()
    assert main(["calibrate", trace]) == 0
    out = capsys.readouterr().out
    # the embedded engine declares no continuous batching: batch makespan is fitted, per request refused
    assert "per-request figures refused" in out and "held-out median error (batch makespan):" in out
    cal = json.loads((tmp_path / "r" / "trace" / "calibration.json").read_text())
    assert cal["calibration_batches"] == [0, 2] and cal["holdout_batches"] == [1, 3]
    assert set(cal["fitted"]) == {"speedup_ratio", "decode_speedup_ratio"} == set(cal["parameters_fitted"])
    assert cal["holdout"]["all"]["request_e2e"]["n"] == 0 and "batch makespan" in cal["objective"]
    mk = cal["holdout"]["all"]["batch_makespan"]
    assert mk["n"] == 2 and 0 <= mk["median_ape"] <= mk["p90_ape"]
    assert (tmp_path / "r" / "trace" / "calibration.png").read_bytes().startswith(b"\x89PNG")
    rep = run(trace)
    assert rep["timing_model"].startswith("calibrated") and "held-out" in rep["note"]
    assert "uncalibrated" in run(trace, use_calibration=False)["timing_model"]


def test_calibrate_gives_per_request_error_for_an_engine_that_declares_continuous_batching(tmp_path):
    """A trace whose engine declares ``batching: continuous`` (vLLM) is fitted and scored per request."""
    from unirl.api import RunConfig
    from unirl_replay_trace.calibrate import calibrate

    cfg = RunConfig.model_validate({"run": {"output_dir": str(tmp_path), "name": "r"},
                                    "rollout": {"engine": "vllm", "options": {"engine_args": {"max_num_seqs": 4}}},
                                    "trace": {"exporter": "dynamo-agentic", "options": {}}})
    exp = build_exporter(cfg)
    for i in range(4):
        samples = [turn(sample(f"p{j}@train-{i}/0", prompt=[1 + j, 2 + i] + list(range(3, 19))), [5] * 8,
                        sub=0, first=4 + 10 * (j // 4), fin=12 + 10 * (j // 4)) for j in range(8)]
        exp.record(phase="train", step=i, version=1, samples=samples)
    trace = exp.close()
    manifest = json.loads((tmp_path / "r" / "trace" / "manifest.json").read_text())
    assert manifest["provenance"]["engine"]["batching"] == "continuous"
    cal = calibrate(trace)
    assert cal["per_request_refused"] is None and cal["engine_args"]["max_num_seqs"] == 4
    e2e = cal["holdout"]["all"]["request_e2e"]
    assert e2e["n"] == 2 * 8 and 0 <= e2e["median_ape"] <= e2e["p90_ape"]
    assert "per-request e2e" in cal["objective"]
