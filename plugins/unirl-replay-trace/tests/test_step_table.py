"""The mocker step-cost table that ``unirl trace calibrate --step-table`` fits (unirl_replay_trace.step_table).

Oracle: batches generated from a known cost model (a prefill rate per prompt token; a decode step of
``a + b * active KV tokens``), timed the way a sync capture records them; the fit must recover the model.
The NPZ it writes is checked by Dynamo's own format test, and a calibration with it replays in real Dynamo."""

from __future__ import annotations

import json
import shutil

import pytest
from replay_trace_support import build_exporter, sample, turn

from unirl.api import ConfigError
from unirl_replay_trace import step_table

RATE, A, B = 0.25, 30.0, 0.02  # ms per prompt token; decode step ms = A + B * active KV tokens
LENGTHS = [1, 2, 2, 3, 4, 4, 4, 6]  # new tokens of each request of a batch (prompt: 10 + batch tokens)


def _batch(b: int) -> tuple[list[dict], list[dict]]:
    isl = [10 + b] * len(LENGTHS)
    first = RATE * sum(isl)
    finish, t = {1: first}, first
    for k in range(2, max(LENGTHS) + 1):  # the step that draws token k: the rows with >= k tokens run
        t += A + B * sum(i + k - 0.5 for i, n in zip(isl, LENGTHS, strict=True) if n >= k)
        finish[k] = t
    work = [{"request_id": f"b{b}r{j}", "input_length": isl[j]} for j in range(len(LENGTHS))]
    out = [{"kind": "request", "request_id": f"b{b}r{j}", "batch": b, "submitted_ms": 0.0, "first_token_ms": first,
            "finished_ms": finish[n], "new_tokens": n} for j, n in enumerate(LENGTHS)]
    return work, out


def test_fit_recovers_the_cost_model_the_batches_were_timed_with():
    work, out = [], []
    for b in range(3):
        w, o = _batch(b)
        work, out = work + w, out + o
    coef = step_table.fit(work, out, [0, 2])
    assert coef["prefill_ms_per_prompt_token"] == pytest.approx(RATE)
    assert coef["decode_step_ms"] == pytest.approx(A) and coef["decode_ms_per_active_kv_token"] == pytest.approx(B)
    assert coef["prefill_points"] == 2  # batch 1 is not a fitting batch: not read


def test_npz_is_in_dynamos_mocker_format(tmp_path):
    from dynamo.mocker.utils.planner_profiler_perf_data_converter import is_mocker_format_npz

    path = step_table.write({"prefill_ms_per_prompt_token": RATE, "decode_step_ms": A,
                             "decode_ms_per_active_kv_token": B}, tmp_path / "t.npz")
    assert is_mocker_format_npz(path)
    import numpy as np

    with np.load(path) as t:
        assert t["decode_itl"][3, 0] == pytest.approx(A + B * t["decode_active_kv_tokens"][3])
        assert t["prefill_ttft_ms"][5] == pytest.approx(RATE * t["prefill_isl"][5])


def test_no_measured_decode_is_refused_in_one_line():
    with pytest.raises(ValueError, match="a step table needs measured first-token and finish times"):
        step_table.fit([], [], [0])


def _vllm_trace(tmp_path, first: bool = True) -> str:
    from unirl.api import RunConfig

    cfg = RunConfig.model_validate({"run": {"output_dir": str(tmp_path), "name": "r"},
                                    "rollout": {"engine": "vllm", "options": {"engine_args": {"max_num_seqs": 4}}},
                                    "trace": {"exporter": "dynamo-agentic", "options": {}}})
    exp = build_exporter(cfg)
    for i in range(4):
        samples = [turn(sample(f"p{j}@train-{i}/0", prompt=[1 + j, 2 + i] + list(range(3, 19))), [5] * (2 + j % 4),
                        sub=0, first=4 + 10 * (j // 4) if first else None, fin=12 + 10 * (j // 4) + 3 * (j % 4)) for j in range(8)]
        exp.record(phase="train", step=i, version=1, samples=samples)
    return exp.close()


def test_calibrate_with_a_step_table_replays_with_it(tmp_path):
    from unirl_replay_trace.calibrate import calibrate
    from unirl_replay_trace.replay import run

    trace = _vllm_trace(tmp_path)
    cal = calibrate(trace, step_table=True)
    d = tmp_path / "r" / "trace"
    assert (d / step_table.STEP_TABLE_FILE).is_file() and cal["step_table"]["prefill_points"] == 2  # fitting half
    assert cal["engine_args_given"]["timing_model"] == step_table.timing_model(d / step_table.STEP_TABLE_FILE)
    assert cal["holdout"]["all"]["request_e2e"]["n"] == 16
    (d / "calibration.json").write_text(json.dumps(cal))
    assert run(trace)["timing_model"].startswith("calibrated")
    moved = tmp_path / "moved"  # the run directory moved: the replay finds the table next to the trace
    shutil.move(tmp_path / "r", moved)
    assert run(moved / "trace")["timing_model"].startswith("calibrated")
    (moved / "trace" / step_table.STEP_TABLE_FILE).unlink()  # it reads the table back: without it, Dynamo fails
    with pytest.raises(Exception, match="NPZ|npz|No such file"):
        run(moved / "trace")


def test_calibrate_refuses_a_step_table_it_cannot_fit(tmp_path):
    from unirl_replay_trace.calibrate import calibrate

    trace = _vllm_trace(tmp_path, first=False)  # no first-token time measured: no prefill to fit
    with pytest.raises(ConfigError, match=r"--step-table: .*calibrate without --step-table"):
        calibrate(trace, step_table=True)
