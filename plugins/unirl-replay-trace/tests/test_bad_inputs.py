"""Bad input to the trace plugin: one message naming the field or file and the fix, exit 2, and
nothing expensive run or overwritten (a partial-rollout capture refused at preflight, a damaged trace named,
a user's file at an output path left byte for byte)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from replay_trace_support import agentic_group, build_exporter, config

from unirl.api import RunConfig, load_kernel
from unirl.cli import main
from unirl.preflight import preflight
from unirl_replay_trace import replay

RECIPE = str(Path(__file__).resolve().parents[3] / "recipes" / "arith-tiny.yaml")


def _trace(tmp_path: Path) -> Path:
    ex = build_exporter(config(tmp_path))
    ex.record(phase="train", step=0, version=1, samples=agentic_group())
    return Path(ex.close())


@pytest.fixture
def no_replay(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the replay ran although its input or output was refused")

    monkeypatch.setattr(replay, "run", refuse)


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------ preflight: what a capture cannot replay


def test_an_agentic_partial_rollout_capture_is_a_preflight_violation():
    """A carried tail spans weight versions and a dropped tail's requests belong to no batch: refused
    before training, not discovered at close."""
    agentic = {"trace": {"exporter": "dynamo-agentic"}, "rollout": {"controller": "agentic"}}
    cfg = RunConfig(**agentic, plugins={"agentic": {"over_generate": 1.25}})
    got = [v for v in preflight(cfg, load_kernel()) if v.source == "unirl-replay-trace"]
    assert [v.field for v in got] == ["plugins.agentic.over_generate"]
    assert "over_generate=1.0" in got[0].fix
    ok = RunConfig(**agentic, plugins={"agentic": {"over_generate": 1.0}})
    assert [v for v in preflight(ok, load_kernel()) if v.source == "unirl-replay-trace"] == []


@pytest.mark.parametrize("exporter", ["mooncake", "dynamo-agentic"])
@pytest.mark.parametrize("mode", ["async", "stream"])
def test_async_and_stream_captures_pass_preflight(exporter, mode):
    """Replayed as one arrival stream (issue 73), no longer refused."""
    cfg = RunConfig(trace={"exporter": exporter}, rollout={"mode": mode})
    assert [v for v in preflight(cfg, load_kernel()) if v.source == "unirl-replay-trace"] == []


# ------------------------------------------------------------------ a damaged trace


def test_a_truncated_manifest_is_named_with_the_fix(tmp_path, capsys, no_replay):
    trace = _trace(tmp_path)
    manifest = trace / "manifest.json"
    manifest.write_text(manifest.read_text()[:200])
    assert main(["trace", "replay", str(tmp_path / "r")]) == 2
    err = _error(capsys)
    assert f"{manifest}: not a readable trace manifest" in err and "truncated?" in err
    assert "fix: capture the trace again" in err
    assert not (trace / "report.json").exists()


@pytest.mark.parametrize(("mutate", "words"), [
    (lambda m: [m], "a JSON list, not a trace manifest"),
    (lambda m: {k: v for k, v in m.items() if k != "batches"}, "field 'batches' is missing, expected a list"),
    (lambda m: {**m, "block_size": "16"}, "field 'block_size' is a JSON string, expected an integer"),
    (lambda m: {**m, "batches": [{"batch": 0}]}, "batches[0] lacks an integer 'batch' or 'requests'"),
])
def test_a_malformed_manifest_is_named(tmp_path, mutate, words):
    from unirl.api import ConfigError

    trace = _trace(tmp_path)
    m = trace / "manifest.json"
    m.write_text(json.dumps(mutate(json.loads(m.read_text()))))
    with pytest.raises(ConfigError, match="fix: capture the trace again") as err:
        replay.load(trace)
    assert str(m) in str(err.value) and words in str(err.value)


def test_a_truncated_workload_file_is_named_with_its_line(tmp_path):
    from unirl.api import ConfigError

    trace = _trace(tmp_path)
    w = trace / "workload.jsonl"
    w.write_text(w.read_text()[:-40])
    with pytest.raises(ConfigError, match=r"workload.jsonl: line 4 is not valid JSON .*fix: capture"):
        replay.load(trace)
    w.unlink()
    with pytest.raises(ConfigError, match=r"workload.jsonl: cannot read this trace file \(No such file"):
        replay.load(trace)


# ------------------------------------------------------------------ output paths


@pytest.mark.parametrize("flag", ["--json", "--png"])
def test_a_users_file_at_an_output_path_survives(tmp_path, capsys, no_replay, flag):
    _trace(tmp_path)
    mine = tmp_path / ("notes.json" if flag == "--json" else "holiday.png")
    body = b'{"mine": true}\n' if flag == "--json" else b"\x89PNG\r\n\x1a\nnot a plot of unirl"
    mine.write_bytes(body)
    assert main(["trace", "replay", str(tmp_path / "r"), flag, str(mine)]) == 2
    err = _error(capsys)
    assert f"{flag} {mine}: the file exists and is not a trace replay" in err
    assert "fix: choose another path, or pass --force to overwrite it" in err
    assert mine.read_bytes() == body


def test_default_outputs_are_refused_when_not_ours_and_replaced_when_they_are(tmp_path, capsys):
    trace = _trace(tmp_path)
    (trace / "report.json").write_text("my own notes\n")
    assert main(["trace", "replay", str(tmp_path / "r")]) == 2
    assert "--json " in _error(capsys) and (trace / "report.json").read_text() == "my own notes\n"
    assert main(["trace", "replay", str(tmp_path / "r"), "--force"]) == 0  # --force: the user said so
    capsys.readouterr()
    out, png = tmp_path / "out" / "rep.json", tmp_path / "out" / "plot.any"  # parents made, suffix ignored
    for _ in range(2):  # a second run replaces what the first wrote
        assert main(["trace", "replay", str(tmp_path / "r"), "--json", str(out), "--png", str(png)]) == 0
    assert json.loads(out.read_text())["kind"] == replay.REPORT_KIND
    assert png.read_bytes().startswith(b"\x89PNG") and replay.PLOT_MARK.encode() in png.read_bytes()


def test_an_output_under_a_file_or_at_a_directory_is_refused(tmp_path, capsys, no_replay):
    _trace(tmp_path)
    (tmp_path / "afile").write_text("x")
    assert main(["trace", "replay", str(tmp_path / "r"), "--json", str(tmp_path / "afile" / "r.json")]) == 2
    assert "afile is a file, not a directory" in _error(capsys)
    assert main(["trace", "replay", str(tmp_path / "r"), "--png", str(tmp_path)]) == 2
    assert "is a directory" in _error(capsys)
