"""The fleet the Dynamo mocker is told about (issue 73, item 4): the scheduling limits a trace records
reach every replay, and ``unirl trace replay --workers N`` predicts another fleet size. Dynamo is real
(1.6.1); the oracle of the what-if is queueing arithmetic: identical requests, a batch limit of 8, twice
the workers, half the waves."""

from __future__ import annotations

import json

import pytest
from replay_trace_support import build_exporter, sample, turn

from unirl.api import ConfigError, RunConfig
from unirl_replay_trace.fleet import known_engine_args, parse_fleet, replay_args


def test_known_engine_args_are_the_options_spelled_as_mocker_scheduler_arguments():
    manifest = {"block_size": 16, "provenance": {"engine": {
        "options": {"enable_prefix_caching": False, "placement": "inprocess",
                    "engine_args": {"max_num_batched_tokens": 4096, "max_num_seqs": True, "dtype": "float32"}},
        "max_num_seqs": 256, "workers": ["a", "b"]}}}
    assert known_engine_args(manifest) == {"enable_prefix_caching": False, "max_num_batched_tokens": 4096,
                                           "max_num_seqs": 256}  # a boolean is no count; dtype is no knob
    args = replay_args(manifest, parse_fleet(workers=3, engine=["max_num_seqs=8"]), {"speedup_ratio": 2.0})
    assert args["num_workers"] == 3
    assert args["extra_engine_args"]["engine"] == {"block_size": 16, "enable_prefix_caching": False,
                                                   "max_num_batched_tokens": 4096, "max_num_seqs": 8,
                                                   "speedup_ratio": 2.0}
    assert replay_args(manifest, None, None)["num_workers"] == 2  # the captured workers


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"workers": 0}, "--workers 0"),
    ({"router_mode": "nearest"}, "--router-mode 'nearest'"),
    ({"engine": ["speedup_ratio=2"]}, "--engine 'speedup_ratio=2'"),
    ({"engine": ["max_num_seqs=-1"]}, "positive integer"),
    ({"engine": ["enable_chunked_prefill=maybe"]}, "true or false"),
])
def test_bad_fleet_flags_are_one_line_errors_naming_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag.replace("(", r"\(")) as exc:
        parse_fleet(**kwargs)
    assert "\n" not in str(exc.value)


def test_workers_whatif_predicts_half_the_waves_at_twice_the_workers(tmp_path, capsys):
    from unirl_replay_trace.cli import main

    cfg = RunConfig.model_validate({"run": {"output_dir": str(tmp_path), "name": "r"},
                                    "rollout": {"options": {"batch_size": 8}},
                                    "trace": {"exporter": "dynamo-agentic", "options": {}}})
    exp = build_exporter(cfg)
    out = list(range(100, 164))
    samples = [turn(sample(f"p{i}@train-0/0", prompt=[1 + i] + list(range(2, 18))), out, sub=0, first=5, fin=50)
               for i in range(64)]
    exp.record(phase="train", step=0, version=1, samples=samples)
    trace = exp.close()
    assert json.loads((tmp_path / "r" / "trace" / "manifest.json").read_text())["provenance"]["engine"][
        "max_num_seqs"] == 8
    assert main(["replay", trace, "--workers", "2"]) == 0
    assert "what-if" in capsys.readouterr().out
    w = json.loads((tmp_path / "r" / "trace" / "report.json").read_text())["whatif"]
    assert w["captured_workers"] == 1 and w["fleet"]["workers"] == 2
    assert w["captured_engine_args"]["max_num_seqs"] == 8
    # 64 identical requests, 8 at a time: 8 waves on one worker, 4 on each of two
    assert 0.4 < w["median_batch_ratio_whatif_over_captured"] < 0.6
    assert w["rollout_ms_predicted_whatif"] < w["rollout_ms_predicted_captured_fleet"]
    assert main(["replay", trace, "--workers", "1", "--engine", "max_num_seqs=64", "--force"]) == 0
    w1 = json.loads((tmp_path / "r" / "trace" / "report.json").read_text())["whatif"]
    assert w1["median_batch_ratio_whatif_over_captured"] < 0.6  # one wave of 64 instead of 8 waves of 8
