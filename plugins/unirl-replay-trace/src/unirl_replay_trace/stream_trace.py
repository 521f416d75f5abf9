"""Async and stream runs as one continuous arrival stream, with weight syncs as pauses (issue 73 item 3).

Why one stream: a sync run's rollout batches are separated by barriers (the trainer waits for the whole
batch), so each batch replays alone from its own t=0 (:mod:`unirl_replay_trace.formats`). With
``rollout.mode: async`` the next batch generates while the trainer trains, and with ``stream`` the
engine never drains between steps: batches overlap in time, and a per-batch replay would drop the
overlap. So these runs replay as **one** replay unit on **one** clock: the run's first submit is t=0,
every trajectory's first turn arrives at its observed submit time on that clock, and the turns after
it keep their completion dependencies and measured waits.

Weight syncs: the kernel's ``unirl_on_weights_published`` hook gives each sync's window
(``started_ms``: when the engine stopped admitting work, stream mode's pause, drain included;
``ended_ms``: the commit, after which the engine serves again). Dynamo 1.6.1's mocker has no fleet
pause in its replay API (the only fleet control, ``planner_config``, runs Dynamo's own planner; scaling
the workers to 0 through the private ``scaling_policy`` fails the next arrival: "no active workers for
round-robin placement"), so a sync is told to the mocker as a **gap in arrivals**: a first turn observed to arrive inside a sync
window arrives at the window's end. What that leaves out: a request queued *before* the pause that had
not started when it began may be served by the mocker during the pause (the engine held it), and a
later turn's measured wait already includes any pause it sat through.

The neutral files keep their per-batch form (``workload.jsonl`` / ``outcomes.jsonl``, times from each
batch barrier); ``manifest.json`` gains ``stream`` (the origin, each batch's barrier offset from it,
the sync windows, all in ms from the origin), and :func:`stream_view` rebases rows onto the one clock.
The exporter writes the view as ``<format>/batch-0000.jsonl`` (replay unit 0 = the whole run), and the
replay reads the same view, so ``unirl trace replay`` compares the run as a whole (its makespan as
``batch_readiness``) and per request.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

#: the one replay unit of a stream trace (``batch`` of every row of its view)
STREAM_BATCH = 0
#: run directory -> the sync windows the hook saw, in commit order (absolute ``now_ms`` times)
_SYNCS: dict[str, list[dict[str, float]]] = {}
_TIMES = ("submitted_ms", "first_token_ms", "finished_ms")


def remember_sync(config: Any, version: int, started_ms: float, ended_ms: float) -> None:
    """File one committed sync's window (called by the plugin's ``unirl_on_weights_published``)."""
    _SYNCS.setdefault(str(config.run_dir), []).append(
        {"version": int(version), "start": float(started_ms), "end": float(ended_ms)})


def syncs_of(config: Any) -> list[dict[str, float]]:
    return list(_SYNCS.get(str(config.run_dir), []))


def is_stream(manifest: dict[str, Any]) -> bool:
    """A trace captured from an async or stream run (replayed as one arrival stream)."""
    return isinstance(manifest.get("stream"), dict)


def stream_section(batches: list[Any], syncs: list[dict[str, float]], mode: str) -> dict[str, Any]:
    """``manifest["stream"]``: the run's origin (its first submit, unix ms), each batch's barrier offset
    from it and each sync window after it, in ms from the origin (3 decimals, like every trace time)."""
    barriers = [b.barrier_unix_ms for b in batches if b.barrier_unix_ms > 0]
    origin = min(barriers) if barriers else 0.0
    return {"mode": mode, "origin_unix_ms": origin,
            "batch_offsets_ms": {str(b.index): round(b.barrier_unix_ms - origin, 3)
                                 for b in batches if b.barrier_unix_ms > 0},
            "syncs": [{"version": s["version"], "start_ms": round(s["start"] - origin, 3),
                       "end_ms": round(s["end"] - origin, 3)} for s in syncs if barriers and s["end"] >= origin],
            "pause_as": "gap in arrivals: a first turn observed inside a sync window arrives at its end"}


def held(t: float, syncs: list[dict[str, Any]]) -> float:
    """``t`` on the stream clock, moved to the end of a sync window it falls strictly inside."""
    for s in syncs:
        if s["start_ms"] < t < s["end_ms"]:
            return s["end_ms"]
    return t


def stream_problems(workload: list[dict[str, Any]]) -> list[str]:
    """What one stream cannot hold: two requests of the run with one id (a replay joins by id)."""
    dup = [rid for rid, n in Counter(w["request_id"] for w in workload).items() if n > 1]
    return [f"request id {rid} occurs in more than one rollout batch; one arrival stream joins by id"
            for rid in dup[:5]]


def stream_view(manifest: dict[str, Any], workload: list[dict[str, Any]],
                outcomes: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """The trace as one replay unit on the stream clock; a sync trace is returned unchanged.

    Workload rows: ``batch`` 0, the captured batch kept as ``captured_batch``, ``arrival_ms`` (first
    turns) = batch offset + arrival, held past a sync window; rows ordered by their group's first
    arrival (a group's rows keep their order, so parents stay before children). Outcome rows: request
    times shifted by their batch's offset (measured, never held), one ``batch`` row at the origin."""
    if not is_stream(manifest):
        return manifest, workload, outcomes
    st = manifest["stream"]
    off = {int(k): float(v) for k, v in (st.get("batch_offsets_ms") or {}).items()}
    syncs = st.get("syncs") or []
    rows = []
    for w in workload:
        seen = None if w.get("arrival_ms") is None else round(off.get(int(w["batch"]), 0.0) + w["arrival_ms"], 3)
        a = None if seen is None else held(seen, syncs)
        rows.append({**w, "batch": STREAM_BATCH, "captured_batch": w["batch"], "arrival_ms": a,
                     "held_from_ms": seen if a != seen else None})
    first: dict[Any, float] = {}
    for w in rows:
        if w["arrival_ms"] is not None:
            first[w["group_id"]] = min(first.get(w["group_id"], w["arrival_ms"]), w["arrival_ms"])
    order = {g: i for i, g in enumerate(dict.fromkeys(w["group_id"] for w in rows))}
    rows.sort(key=lambda w: (first.get(w["group_id"], 0.0), order[w["group_id"]]))
    outs = [{**o, "batch": STREAM_BATCH, "captured_batch": o["batch"],
             **{k: None if o.get(k) is None else round(o[k] + off.get(int(o["batch"]), 0.0), 3) for k in _TIMES}}
            for o in outcomes if o["kind"] == "request"]
    outs.append({"kind": "batch", "batch": STREAM_BATCH, "barrier_unix_ms": st.get("origin_unix_ms")})
    return {**manifest, "batches": [_unit_meta(manifest["batches"])], "captured_batches": manifest["batches"]}, rows, outs


def _unit_meta(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest row of the one replay unit: counts summed, the cache state of the run's start."""
    return {"batch": STREAM_BATCH, "phase": "stream", "step": None,
            "version": min((b.get("version", 0) for b in batches), default=0), "fingerprint": None,
            **{k: sum(int(b.get(k) or 0) for b in batches) for k in ("requests", "groups", "trajectories")},
            "initial_cache": (batches[0].get("initial_cache") if batches else None) or {"state": "unknown"},
            "captured_batches": len(batches)}


def stream_summary(manifest: dict[str, Any], workload: list[dict[str, Any]], report: dict[str, Any]) -> dict[str, Any]:
    """The run as a whole, beside the report's per-request rows: the syncs and the pause they put in the
    stream, the arrivals held by one, and per captured batch its readiness (last finish, from the run's
    first submit) and span (from the batch's first arrival), predicted against measured.

    Why the span: the run's makespan is mostly the observed arrivals (the last batch arrives near the end
    whatever the engine does), so it says little about service; a batch's span is what the engine took."""
    st = manifest["stream"]
    batch_of = {w["request_id"]: w["captured_batch"] for w in workload}
    per: dict[int, dict[str, list[float]]] = {}
    for r in report.get("per_request") or []:
        m, p = r.get("measured"), r.get("predicted")
        if m is None or r["request_id"] not in batch_of:
            continue
        b = per.setdefault(batch_of[r["request_id"]], {"ma": [], "mt": [], "pa": [], "pt": []})
        b["ma"].append(m["arrival"]), b["mt"].append(m["terminal"])
        b["pa"].append(p["arrival"]), b["pt"].append(p["terminal"])
    rows = [{"captured_batch": k, "measured_ready_ms": max(v["mt"]), "predicted_ready_ms": max(v["pt"]),
             "measured_span_ms": round(max(v["mt"]) - min(v["ma"]), 3),
             "predicted_span_ms": round(max(v["pt"]) - min(v["pa"]), 3)} for k, v in sorted(per.items())]
    ape = [abs(r["predicted_span_ms"] - r["measured_span_ms"]) / r["measured_span_ms"]
           for r in rows if r["measured_span_ms"] > 0]
    return {"mode": st.get("mode"), "syncs": len(st.get("syncs") or []),
            "pause_ms_total": round(sum(x["end_ms"] - x["start_ms"] for x in st.get("syncs") or []), 3),
            "held_arrivals": sum(1 for w in workload if w.get("held_from_ms") is not None),
            "pause_as": st.get("pause_as"), "captured_batches": rows,
            "batch_span_median_ape": statistics.median(ape) if ape else None}


def stream_lines(summary: dict[str, Any] | None) -> list[str]:
    """The ``stream`` section as report text (empty for a sync trace)."""
    if not summary:
        return []
    ape = summary["batch_span_median_ape"]
    out = [f"  stream ({summary['mode']}): one arrival stream; {summary['syncs']} sync(s), "
           f"{summary['pause_ms_total']:.1f} ms paused, {summary['held_arrivals']} arrival(s) held to a sync's end; "
           f"captured batch span (first arrival to last finish) median |error| "
           f"{'-' if ape is None else f'{100 * ape:.1f}%'}"]
    out += [f"    captured batch {b['captured_batch']}: span measured {b['measured_span_ms']:.1f} ms, predicted "
            f"{b['predicted_span_ms']:.1f} ms; ready at {b['measured_ready_ms']:.1f} / {b['predicted_ready_ms']:.1f} ms"
            for b in summary["captured_batches"]]
    return out
