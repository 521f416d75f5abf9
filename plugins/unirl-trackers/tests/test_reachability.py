"""Trackers checked in preflight (issue 66, item 6): W&B's credentials, the MLflow server's reachability.

Each failure is one violation naming the field and the fix, found before any model is built, and a
server that never answers costs the probe's timeout, not MLflow's minutes of retries. The servers here
are real sockets on loopback: one refusing, one accepting but silent, one answering HTTP 404 (not
MLflow) and one answering MLflow's REST path (``mlflow server`` itself needs flask, not installed).
"""

from __future__ import annotations

import http.server
import socket
import threading
from pathlib import Path

import pytest

from unirl.api import load_config, load_kernel
from unirl.preflight import preflight
from unirl_trackers import reachability

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "arith-tiny.yaml"


def _tracker_violations(*overrides: str):
    cfg = load_config(RECIPE, list(overrides))
    return {v.field: v for v in preflight(cfg, load_kernel()) if v.source == "unirl-trackers"}


@pytest.fixture
def no_wandb_login(monkeypatch, tmp_path):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no entry for api.wandb.ai


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Answer(http.server.BaseHTTPRequestHandler):
    """200 on MLflow's search path, 404 elsewhere (what a web server that is not MLflow says)."""

    def do_GET(self):  # noqa: N802 - http.server's name
        ok = self.path.startswith("/api/2.0/mlflow/experiments/search")
        self.send_response(200 if ok else 404)
        self.end_headers()
        self.wfile.write(b'{"experiments": []}' if ok else b"not found")

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_wandb_without_credentials_is_one_violation_with_the_fix(no_wandb_login):
    got = _tracker_violations("logging.trackers=[wandb]")
    v = got["logging.options.wandb"]
    assert "no credentials" in v.message and "wandb login" in v.fix and "mode: offline" in v.fix
    assert "\n" not in str(v)


@pytest.mark.parametrize("offline", [["logging.options.wandb={mode: offline}"], ["logging.options.wandb={mode: disabled}"]])
def test_wandb_offline_needs_no_credentials(no_wandb_login, offline):
    assert _tracker_violations("logging.trackers=[wandb]", *offline) == {}


def test_wandb_mode_from_the_environment(no_wandb_login, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert _tracker_violations("logging.trackers=[wandb]") == {}


def test_wandb_logged_in_but_unreachable(no_wandb_login, monkeypatch, tmp_path):
    port = _closed_port()
    (tmp_path / "netrc").write_text(f"machine 127.0.0.1 login user password {'k' * 40}\n")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    v = _tracker_violations("logging.trackers=[wandb]")["logging.options.wandb"]
    assert f"cannot reach W&B at http://127.0.0.1:{port}" in v.message and "Connection refused" in v.message
    assert "mode: offline" in v.fix


def test_mlflow_refusing_server():
    uri = f"http://127.0.0.1:{_closed_port()}"
    v = _tracker_violations("logging.trackers=[mlflow]", f"logging.options.mlflow.tracking_uri={uri}")[
        "logging.options.mlflow.tracking_uri"]
    assert uri in v.message and "Connection refused" in v.message
    assert "remove logging.options.mlflow.tracking_uri" in v.fix and "\n" not in str(v)


def test_mlflow_silent_server_costs_the_timeout_not_minutes(monkeypatch):
    """A server that accepts the connection and never answers (a stuck host, a black-holing proxy)."""
    monkeypatch.setattr(reachability, "TIMEOUT_S", 0.5)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        uri = f"http://127.0.0.1:{listener.getsockname()[1]}"
        got = _tracker_violations("logging.trackers=[mlflow]", f"logging.options.mlflow.tracking_uri={uri}")
    assert "no answer within 0.5 s" in got["logging.options.mlflow.tracking_uri"].message


def test_mlflow_uri_of_a_server_that_is_not_mlflow(http_server):
    got = _tracker_violations("logging.trackers=[mlflow]", f"logging.options.mlflow.tracking_uri={http_server}/x")
    assert "answered HTTP 404" in got["logging.options.mlflow.tracking_uri"].message


def test_mlflow_server_that_answers_and_the_local_store_pass(http_server):
    assert _tracker_violations("logging.trackers=[mlflow]", f"logging.options.mlflow.tracking_uri={http_server}") == {}
    assert _tracker_violations("logging.trackers=[mlflow]") == {}  # no URI: a local store in the run directory
