"""Which figures a replay may give for a trace, from the engine's declared schedule (issue 73, item 2).

Dynamo's mocker batches continuously: a request is admitted whenever a slot frees. An engine that
declares the same (``EngineCapabilities.batching == "continuous"``: vLLM, SGLang) can be compared request
by request. An engine that declares nothing (the embedded engine runs rows in chunks whose slots are not
refilled until the chunk ends) finishes its requests in an order the mocker does not model: measured on
the demo, per-request e2e stayed a median 62 % off after calibration while batch makespan came to 18.5 %.
So for such a trace the report **refuses** per-request latency and group completion (they depend on
the order inside a batch), keeps batch readiness, and a calibration fits batch makespan instead.

The embedded engine merges queued jobs into its running batch (``merges_jobs``, unirl.engine.merged),
and still declares nothing: a job joins only when all its rows fit, and a job larger than its
``batch_size`` (a sync step's whole batch) runs alone in static chunks. Measured on a merged stream
capture (2026-12-07, docs/replay-trace.md): per-request e2e 68 % off uncalibrated, and 39.7 % even at
the one speed that fits that same capture best, above the 35 % a per-request figure would need.

Why not model the chunks in the mocker's terms: its ``max_num_seqs`` caps the rows in flight, but it has
no switch that holds a freed slot empty until the chunk ends; replaying chunks one by one would be a
scheduler of our own, which this plugin does not write.

A trace written before the exporter recorded the declaration (no ``batching`` key) is replayed as
before, per request, and the report says the schedule is undeclared.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

#: the aggregates that depend on the order of requests inside a batch
PER_REQUEST_AGGREGATES = ("ttft", "e2e", "group_completion")


def refusal(manifest: dict[str, Any]) -> str | None:
    """Why per-request figures are refused for this trace, or None when they are given."""
    engine = manifest["provenance"].get("engine") or {}
    if "batching" not in engine or engine["batching"] == "continuous":
        return None
    return (f"per-request figures refused: the engine ({engine.get('name')}) declares no continuous batching "
            "(EngineCapabilities.batching: it admits whole jobs, or runs a large one in static chunks), while "
            "Dynamo's mocker admits a request whenever a slot frees, so the order in which requests finish "
            "inside a batch is not predicted; batch readiness is compared")


def schedule_note(manifest: dict[str, Any]) -> str:
    engine = manifest["provenance"].get("engine") or {}
    if "batching" not in engine:
        return "undeclared (the trace predates the engine's batching declaration): per-request figures given"
    return str(engine["batching"] or "not declared")


def refuse(report: dict[str, Any], why: str, *, keep_rows: bool = True) -> dict[str, Any]:
    """``report`` (from :func:`unirl_replay_trace.replay.compare`) without its per-request figures.

    ``keep_rows``: the joined per-request rows stay in the JSON as a functional check of the workload
    mapping (every request replayed, with its dependencies), flagged; no aggregate is computed from them.
    A calibration drops them too (its error tables would be per-request figures)."""
    report["per_request_refused"] = why
    report["group_completion"] = []
    report["per_request"] = [{**r, "refused": True} for r in report["per_request"]] if keep_rows else []
    for key in PER_REQUEST_AGGREGATES:
        if key in report["aggregate"]:
            report["aggregate"][key] = {"n": 0, "note": "refused: the engine declares no continuous batching"}
    return report


def makespan_objective(report: dict[str, Any]) -> float:
    """Median |log(predicted / measured)| of batch makespan (a refused trace's calibration objective)."""
    logs = [abs(math.log(b["predicted_ms"] / b["measured_ms"])) for b in report["batch_readiness"]
            if b["measured_ms"] > 0 and b["predicted_ms"] > 0]
    return statistics.median(logs) if logs else math.inf
