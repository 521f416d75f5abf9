"""The gate (torch.equal, no tolerance), the atomic artifact with both phases, the report command."""

from __future__ import annotations

import json
import os

import pytest
import torch

from unirl.api import BackwardContext, RunConfig, Sample
from unirl_parity_vllm import gate
from unirl_parity_vllm.artifact import Recorder, write_json_atomic
from unirl_parity_vllm.gate import ParityMismatchError


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.delenv("UNIRL_PARITY_DIR", raising=False)
    c = RunConfig.model_validate({"run": {"output_dir": str(tmp_path), "name": "r"},
                                  "plugins": {"parity": {"enabled": True}}})
    gate.reset(c)
    return c


def ctx(logp, rollout, *, rl_step=0, update=0, mask=None, version=1):
    n = logp.numel()
    s = Sample(id="p0/0", prompt_ids=[2], response_ids=[3] * n, loss_mask=mask or [1] * n,
               rollout_logprobs=rollout.tolist(), versions=[version] * n)
    return BackwardContext(rl_step=rl_step, update=update, micro_batch=0, rank=0, world_size=1, samples=[s],
                           logprobs=logp, rollout_logprobs=rollout)


def test_gate_passes_on_equal_and_fails_on_one_ulp(cfg):
    lp = -torch.rand(100) * 5
    gate.check(ctx(lp, lp.clone()), cfg)
    bumped = lp.clone()
    bumped[17] = torch.nextafter(bumped[17], torch.tensor(0.0))  # one ulp
    with pytest.raises(ParityMismatchError) as err:
        gate.check(ctx(lp, bumped), cfg)
    st = err.value.stats
    assert st["mismatches"] == 1 and st["tokens"] == 100 and 0 < st["max_abs_diff"] < 1e-5
    assert "1 of 100" in str(err.value) and "k3" in str(err.value)
    rec = json.loads((gate.parity_dir(cfg) / "gate-rank0.json").read_text())
    p = rec["phases"]["initial_checkpoint"]
    assert p["tokens"] == 200 and p["mismatches"] == 1 and p["failed"] == 1


def test_gate_ignores_masked_tokens_and_checks_dtype_shape_finite(cfg):
    lp = -torch.rand(10)
    other = lp.clone()
    other[3] = 0.0  # a tool observation (loss_mask 0) is not a model token
    gate.check(ctx(lp, other, mask=[1, 1, 1, 0, 1, 1, 1, 1, 1, 1]), cfg)
    with pytest.raises(ParityMismatchError, match="float64"):
        gate.check(ctx(lp.double(), lp.double()), cfg)
    with pytest.raises(ParityMismatchError, match="shapes"):
        c = ctx(lp, lp.clone())
        c.rollout_logprobs = lp[:9]
        gate.check(c, cfg)
    bad = lp.clone()
    bad[0] = float("nan")
    with pytest.raises(ParityMismatchError, match="non-finite"):
        gate.check(ctx(bad, bad.clone()), cfg)


def test_gate_skips_off_policy_updates(cfg):
    lp = -torch.rand(10)
    gate.check(ctx(lp, lp + 1, update=1), cfg)  # would fail if compared
    assert json.loads((gate.parity_dir(cfg) / "gate-rank0.json").read_text())["skipped_updates"] == 1


def test_json_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "a.json"
    write_json_atomic(path, {"v": 1})

    def fail(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        write_json_atomic(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 1}  # the old artifact is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]  # no temp file left


@pytest.mark.parametrize("policy", ["fail", "warn"])
def test_a_failed_artifact_write_names_the_path_and_fix_and_keeps_the_previous_one(cfg, monkeypatch, caplog, policy):
    """Disk full while the artifact is replaced (injected in core's atomic write, the real path): with
    ``run.on_save_error: fail`` a RunWriteError names the artifact, the bytes and the fix; with ``warn``
    a warning says it and the next step's write succeeds. The artifact already written stays whole."""
    import errno

    import unirl.fsio
    from unirl.api import RunWriteError

    config = cfg.model_copy(update={"run": cfg.run.model_copy(update={"on_save_error": policy})})
    rec = Recorder(config)
    rec.on_weights_published(1, [{"worker": 0, "version": 1, "fingerprint": "aa"}])
    rec.on_step_end(0, {})
    before = rec.path.read_text()
    real = unirl.fsio.os.replace

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(unirl.fsio.os, "replace", full)
    if policy == "fail":
        with pytest.raises(RunWriteError) as info:
            rec.on_step_end(1, {})
        msg = str(info.value)
        assert "parity artifact" in msg and str(rec.path) in msg and "ENOSPC" in msg and "fix:" in msg
        assert "MB" in msg and "run.on_save_error=warn" in msg
    else:
        with caplog.at_level("WARNING", logger="unirl.parity"):
            rec.on_step_end(1, {})
        assert "parity artifact" in caplog.text and "ENOSPC" in caplog.text
    assert rec.path.read_text() == before  # the previous artifact, whole
    assert sorted(p.name for p in rec.path.parent.iterdir() if p.name.startswith(".")) == []  # no temp left
    monkeypatch.setattr(unirl.fsio.os, "replace", real)
    rec.on_step_end(1, {})
    assert json.loads(before)["run"]["steps_done"] == 1 and json.loads(rec.path.read_text())["run"]["steps_done"] == 2


def test_artifact_has_both_phases_and_report_renders(cfg, capsys):
    rec = Recorder(cfg)
    rec.on_weights_published(1, [{"worker": 0, "version": 1, "fingerprint": "aa"}])
    lp = -torch.rand(64)
    gate.check(ctx(lp, lp.clone(), rl_step=0, version=1), cfg)
    rec.on_step_end(0, {})
    rec.on_weights_published(2, [{"worker": 0, "version": 2, "fingerprint": "bb"}])
    doc = json.loads(rec.path.read_text())
    assert doc["verdict"] == "incomplete" and "post_update_reload" not in doc["phases"]
    gate.check(ctx(lp, lp.clone(), rl_step=1, version=2), cfg)
    metrics = {}
    rec.on_step_end(1, metrics)
    doc = json.loads(rec.path.read_text())
    init, post = doc["phases"]["initial_checkpoint"], doc["phases"]["post_update_reload"]
    assert init["tokens"] == 64 and init["mismatches"] == 0 and init["weight_versions"] == [1]
    assert post["weight_versions"] == [2] and post["optimizer_steps_before"] == 1 and post["fingerprints"] == ["bb"]
    assert doc["verdict"] == "pass" and doc["runtime"]["packages"]["torch"]
    assert metrics["parity_post_update_mismatches"] == 0
    from unirl.cli import main

    assert main(["parity", "report", str(rec.path)]) == 0
    out = capsys.readouterr().out
    assert "verdict PASS" in out and "post_update_reload: pass" in out


def test_report_of_a_failed_run_writes_a_histogram(cfg, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rec = Recorder(cfg)
    rec.on_weights_published(1, [])
    lp = -torch.rand(64)
    with pytest.raises(ParityMismatchError):
        gate.check(ctx(lp, lp + 1e-6), cfg)
    rec.on_step_end(0, {})
    from unirl.cli import main

    png = tmp_path / "h.png"
    assert main(["parity", "report", str(rec.path), "--png", str(png)]) == 1
    assert png.is_file() and "verdict FAIL" in capsys.readouterr().out
