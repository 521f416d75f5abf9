"""The W&B and MLflow trackers against the real libraries, offline: a short real training run logs to
both, and what each stored (read back from the W&B offline run file and the MLflow local store) equals
``metrics.jsonl``. A tracker that raises mid-run does not stop the run."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import signal
import struct
import sys
import types
from pathlib import Path

import pytest

if os.environ.get("CI") != "true":  # in CI a missing library fails instead of skipping
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    if importlib.util.find_spec("trackio") is None:  # not imported here: its data directory is fixed at import
        pytest.skip("trackio is not installed")

from unirl.api import (  # noqa: E402
    PreflightError,  # noqa: E402
    Tracker,
    hookimpl,
    load_config,
    load_kernel,
    train,  # noqa: E402
)

ROOT = Path(__file__).resolve().parents[3]
SMALL = [
    "sft.steps=0", "trainer.steps=3", "trainer.prompts_per_step=4", "trainer.eval_every=2", "trainer.eval_k=1",
    "trainer.progress=false", "trainer.export_hf=false", "data.arith.n_train=32", "data.arith.n_eval=4",
    "rollout.n=2", "rollout.max_new_tokens=4", "model.build={hidden_size: 64, intermediate_size: 128}",
]


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))


def config(tmp_path, name, *extra):
    return load_config(ROOT / "recipes" / "arith-tiny.yaml",
                       [*SMALL, f"run.output_dir={tmp_path}", f"run.name={name}", *extra])


def jsonl_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def expected(run_dir: Path) -> dict[str, dict[int, float]]:
    """``{metric: {step: value}}`` of metrics.jsonl's finite numbers: what every tracker must hold."""
    out: dict[str, dict[int, float]] = {}
    for row in jsonl_rows(run_dir):
        for k, v in row.items():
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                out.setdefault(k, {})[row["step"]] = float(v)
    return out


# ----------------------------------------------------------------------------- W&B offline run file


def wandb_records(path: Path):
    """Every record of a W&B ``.wandb`` transaction log, read independently of wandb's own (Go)
    reader: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each
    ``crc32 (4) | length (2) | type (1: full, 2: first, 3: middle, 4: last)``, as LevelDB's log."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not a W&B transaction log"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            yield rec


def wandb_history(run_dir: Path) -> tuple[dict[str, dict[int, float]], dict[str, str], Path]:
    (offline,) = list((run_dir / "wandb").glob("offline-run-*"))
    (log,) = list(offline.glob("*.wandb"))
    history: dict[str, dict[int, float]] = {}
    params: dict[str, str] = {}
    for rec in wandb_records(log):
        if rec.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            step = int(items.get("_step", rec.history.step.num))
            for k, v in items.items():
                if not k.startswith("_"):
                    history.setdefault(k, {})[step] = float(v)
        elif rec.WhichOneof("record_type") == "run":  # the run's config travels in its run record
            for i in rec.run.config.update:
                params[i.key] = json.loads(i.value_json)
    return history, params, offline


# ----------------------------------------------------------------------------- MLflow local store


def mlflow_history(run_dir: Path):
    from mlflow import MlflowClient

    from unirl_trackers.mlflow_tracker import local_store

    client = MlflowClient(tracking_uri=local_store(run_dir))
    run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
    history = {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in run.data.metrics}
    return history, run, client


def test_wandb_and_mlflow_hold_exactly_what_metrics_jsonl_holds(tmp_path):
    cfg = config(tmp_path, "both", "logging.trackers=[tensorboard, wandb, mlflow]", "trainer.plot=true",
                 "logging.options={wandb: {project: unirl-test}}")
    result = train(cfg, load_kernel())
    run_dir = tmp_path / "both"
    assert result.steps_done == 3
    want = expected(run_dir)
    assert {"reward", "loss", "eval"} <= set(want) and len(want["reward"]) == 3 and 0 in want["eval"]

    got, params, offline = wandb_history(run_dir)
    assert got == want, "the W&B offline run holds exactly metrics.jsonl's rows"
    assert params["rollout.n"] == "2" and params["version/unirl-trackers"] and params["git_revision"]
    assert (offline / "files" / "curves.png").is_file(), "the curves PNG is saved with the W&B run"

    got, run, client = mlflow_history(run_dir)
    assert got == want, "the MLflow local store holds exactly metrics.jsonl's rows"
    assert run.data.params["trainer.steps"] == "3" and "version/unirl-core" in run.data.params
    assert run.data.params["git_revision"]
    assert run.info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["curves.png"]
    assert list((run_dir / "mlartifacts").rglob("curves.png")), "artifacts stay in the run directory"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")), "core's TensorBoard still written"


def test_trackio_holds_exactly_what_metrics_jsonl_holds_offline(tmp_path, caplog):
    """Trackio's local SQLite store, read back with its own storage API, against ``metrics.jsonl``;
    the run's parameters are its config; the curves PNG is logged as an artifact without a failure."""
    if "trackio" in sys.modules:  # imported earlier in this process: its data directory is already fixed
        from trackio.utils import TRACKIO_DIR as data
        where = ""
    else:
        data = tmp_path / "trackio-data"
        where = f", dir: '{data}'"
    project = f"unirl-test-{tmp_path.name}"
    cfg = config(tmp_path, "tk", "logging.trackers=[trackio]", "trainer.plot=true",
                 f"logging.options={{trackio: {{project: {project}{where}}}}}")
    with caplog.at_level(logging.WARNING, logger="unirl.trackers"):
        result = train(cfg, load_kernel())
    assert result.steps_done == 3
    assert not [r for r in caplog.records if "failed" in r.getMessage()], "no tracker call failed"
    from trackio.sqlite_storage import SQLiteStorage

    assert (Path(data) / f"{project}.db").is_file(), "the project's store is in the configured directory"
    assert SQLiteStorage.get_runs(project) == ["tk"]
    got: dict[str, dict[int, float]] = {}
    for row in SQLiteStorage.get_logs(project, "tk"):
        for k, v in row.items():
            if k not in ("step", "timestamp") and isinstance(v, int | float):
                got.setdefault(k, {})[row["step"]] = float(v)
    want = expected(tmp_path / "tk")
    assert {"reward", "loss", "eval"} <= set(want)
    assert got == want, "the Trackio store holds exactly metrics.jsonl's rows"
    params = SQLiteStorage.get_run_config(project, "tk")
    assert params["rollout.n"] == "2" and params["version/unirl-trackers"] and params["git_revision"]


class Flaky(Tracker):
    """Raises at its second row and every row after: a tracker broken mid-run."""

    calls = 0

    def log(self, metrics, step):
        Flaky.calls += 1
        if Flaky.calls >= 2:
            raise ConnectionError("dashboard unreachable")

    def close(self):
        raise RuntimeError("close failed too")


def test_a_tracker_raising_mid_run_does_not_stop_it(tmp_path, caplog):
    kernel = load_kernel()
    module = types.ModuleType("flaky_tracker")
    module.unirl_trackers = hookimpl(lambda: {"flaky": Flaky})
    kernel.register(module, entry_point="flaky", dist="flaky-test", version="0")
    Flaky.calls = 0
    cfg = config(tmp_path, "flaky", "logging.trackers=[flaky, mlflow]", "trainer.eval_every=0")
    with caplog.at_level(logging.WARNING, logger="unirl.trackers"):
        result = train(cfg, kernel)
    assert result.steps_done == 3, "training ran to the end"
    rows = jsonl_rows(tmp_path / "flaky")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # the eval before training, then 3 steps
    got, _, _ = mlflow_history(tmp_path / "flaky")
    assert got == expected(tmp_path / "flaky"), "the other tracker still got every row"
    first = [r.getMessage() for r in caplog.records if "failed in" in r.getMessage()]
    assert len(first) == 1 and "ConnectionError: dashboard unreachable" in first[0], "reported once"
    summary = [r.getMessage() for r in caplog.records if "time(s)" in r.getMessage()]
    assert summary == ["tracker flaky failed 4 time(s) in this run; first: ConnectionError: dashboard unreachable"]


def test_unknown_tracker_is_a_preflight_error_naming_the_installed_ones(tmp_path):
    with pytest.raises(PreflightError) as err:
        train(config(tmp_path, "typo", "logging.trackers=[wandbb]"), load_kernel())
    text = str(err.value)
    assert "logging.trackers[0]" in text and "wandbb" in text
    assert "installed trackers: " in text and all(n in text for n in ("tensorboard", "wandb", "mlflow"))
    assert not (tmp_path / "typo" / "metrics.jsonl").exists(), "refused before anything ran"


def test_bad_tracker_options_and_options_for_an_unlisted_tracker(tmp_path):
    with pytest.raises(PreflightError) as err:
        train(config(tmp_path, "opts", "logging.trackers=[wandb]", "logging.options={wandb: {projekt: x}, "
                     "mlflow: {experiment: y}}"), load_kernel())
    text = str(err.value)
    assert "logging.options.wandb" in text and "projekt" in text
    assert "logging.options.mlflow" in text and "not in logging.trackers" in text


def test_trainer_tensorboard_true_still_works_as_a_deprecated_alias():
    with pytest.warns(DeprecationWarning, match=r"logging.trackers: \[tensorboard\]"):
        cfg = load_config(None, ["trainer.tensorboard=true"])
    assert cfg.logging.trackers == ["tensorboard"]


def test_a_missing_library_names_the_pip_command(monkeypatch):
    import importlib.util

    from unirl_trackers.plugin import unirl_preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    (v,) = unirl_preflight(config=load_config(None, ["logging.trackers=[wandb]"]))
    assert v.field == "logging.trackers[0]" and "pip install 'unirl-trackers[wandb]'" in v.fix


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_resumed_run_continues_its_mlflow_run(tmp_path):
    from unirl.trainer.preempt import Preempted

    class KillAfterStep2:  # SIGTERM as a cluster preempts: the trainer finishes step 2, saves it and exits
        @hookimpl
        def unirl_on_step_end(self, step, metrics, config):
            if step == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    cfg = config(tmp_path, "resumed", "logging.trackers=[mlflow]", "trainer.eval_every=0", "trainer.save_every=2")
    with pytest.raises(Preempted, match="preempted at step 2"):
        train(cfg, load_kernel(extra=[("kill", KillAfterStep2())]))
    run_id = (tmp_path / "resumed" / "mlflow_run_id").read_text().strip()
    cfg = config(tmp_path, "resumed", "logging.trackers=[mlflow]", "trainer.eval_every=0", "trainer.save_every=2",
                 "run.resume=true")
    assert train(cfg, load_kernel()).steps_done == 3
    got, run, client = mlflow_history(tmp_path / "resumed")
    assert run.info.run_id == run_id, "the same MLflow run, not a second one"
    assert got == expected(tmp_path / "resumed"), "its history is metrics.jsonl's, each step once"
    assert len(client.search_runs([run.info.experiment_id])) == 1
