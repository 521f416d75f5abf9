"""Preflight for the trackers: credentials and reachability, with a short timeout, before any model.

Why: a tracker that cannot log is reported by the trainer once and never stops a run, but only after
the model is built: W&B without credentials warned minutes in, and an MLflow server that does not
answer stalled the run for about 4 minutes (MLflow's own retries) with no output, then trained without
it. Here each is one violation with the fix (``wandb login``, offline mode, the URI), found in seconds.
Only the standard library is used: neither ``wandb`` nor ``mlflow`` is imported to check.
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

#: seconds a reachability probe waits for a TCP connection (a run's preflight stays short)
TIMEOUT_S = 3.0
WANDB_HOST = "https://api.wandb.ai"
#: a read-only call of MLflow's REST API that every tracking server answers
MLFLOW_PROBE = "/api/2.0/mlflow/experiments/search?max_results=1"
_OFFLINE = ("offline", "disabled", "dryrun")


def probe(url: str, timeout: float | None = None) -> tuple[int | None, str | None]:
    """``(HTTP status, None)`` when a server answers at ``url`` within ``timeout``, else ``(None, why
    not)``. An HTTP request, not a bare TCP connect: a proxy or a firewall can accept the connection of a
    server that never answers."""
    import urllib.error
    import urllib.request

    timeout = TIMEOUT_S if timeout is None else timeout
    if not urlparse(url).hostname:
        return None, f"{url!r} names no host"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout) as r:  # noqa: S310
            return r.status, None
    except urllib.error.HTTPError as exc:
        return exc.code, None  # a status code is an answer
    except TimeoutError:
        return None, f"no answer within {timeout:g} s"
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, TimeoutError):
            return None, f"no answer within {timeout:g} s"
        return None, f"cannot connect ({getattr(reason, 'strerror', None) or reason})"
    except OSError as exc:
        return None, f"cannot connect ({exc.strerror or exc})"


def _netrc_has(host: str) -> bool:
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        return netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_problem(options: Any, field: str) -> tuple[str, str, str] | None:
    """``(field, problem, fix)`` for an online W&B run without credentials or without a route to the
    server; None for offline / disabled runs (``mode`` or ``WANDB_MODE``) and for a reachable, logged-in one."""
    mode = getattr(options, "mode", None) or os.environ.get("WANDB_MODE")
    if mode in _OFFLINE:
        return None
    base = os.environ.get("WANDB_BASE_URL") or WANDB_HOST
    offline = f"or set {field}.mode: offline (logs under the run directory; `wandb sync` them later)"
    if not os.environ.get("WANDB_API_KEY") and not _netrc_has(urlparse(base).hostname or ""):
        return (field, f"W&B has no credentials for {base} (no WANDB_API_KEY, no ~/.netrc entry), so every "
                f"logged row would be lost", f"run `wandb login`, {offline}")
    _, why = probe(base)
    if why is not None:
        return (field, f"cannot reach W&B at {base}: {why}", f"check the network or WANDB_BASE_URL, {offline}")
    return None


def mlflow_problem(options: Any, field: str) -> tuple[str, str, str] | None:
    """``(field, problem, fix)`` for an MLflow tracking server that does not accept a connection within
    :data:`TIMEOUT_S`; None for the local store (no ``tracking_uri``) and for URIs that are not servers."""
    uri = getattr(options, "tracking_uri", None)
    if not uri or urlparse(uri).scheme not in ("http", "https"):
        return None
    status, why = probe(uri.rstrip("/") + MLFLOW_PROBE)
    if status in (200, 401, 403):  # the tracking API answered (401 / 403: it wants credentials MLflow sends)
        return None
    if status is not None:
        why = f"it answered HTTP {status} to {MLFLOW_PROBE}, so it is not an MLflow tracking server at this URI"
    return (f"{field}.tracking_uri", f"cannot reach the MLflow server {uri}: {why} (MLflow would retry for "
            "minutes, then the run would train without it)", "start the server or fix the URI, or remove "
            f"{field}.tracking_uri to log to a local store in the run directory")
