"""Workload rows -> Dynamo replay input files, one file per rollout batch.

Why one file per batch: a synchronous RL step starts its next rollout only after the whole batch
(and training) is done, a barrier across every GRPO group. ``agentic_mooncake`` dependencies stay
inside one ``play_id`` (one group), so a cross-group barrier is not expressible in one file, and this
module inserts no fake barrier requests. Replaying each batch from its own t=0 *is* the barrier.

Mapping (``dynamo-agentic``, ``agentic_mooncake`` v2): group -> ``play_id``, trajectory (sample) ->
``session_id``, turn k>0 -> a ``completion`` dependency on turn k-1 with ``delay_ms`` = the measured
tool wait. A batch's first turns arrive at their observed submit offset from the barrier
(``not_before_ms`` = ``arrival_ms``; ``arrivals="barrier"`` puts them all at 0, the pre-issue-37
behaviour); later turns have no arrival time of their own (their measured arrival depends on measured
service time, which the predictor must not see).

``mooncake`` (plain): a trajectory is a ``session_id`` whose rows replay as closed-loop turns with
``delay``. Its results carry random uuids and no request id, so a replay of it can only be compared in
aggregate. A branch (two turns continuing one turn) is not a linear session and is rejected.

An async or stream run (batches overlapping in time) is exported as one file holding the whole run on
one clock, its weight syncs as pauses (:mod:`unirl_replay_trace.stream_trace`); ``export`` gets it as one
batch (the stream view) and maps it like any other.

Anything a format cannot represent raises :class:`UnsupportedTrace` listing every case at once;
nothing is approximated (a missing wait is never read as zero).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any

from unirl.api import UniRLError

FORMATS = ("dynamo-agentic", "mooncake")
#: where a replay puts a trajectory's first turn: its observed submit offset, or the batch barrier
ARRIVALS = ("observed", "barrier")
#: the Dynamo release these files were validated against (format, engine-arg nesting, per-request
#: results); written into every manifest and checked against the installed Dynamo at replay
DYNAMO_VALIDATED = "1.6.1"
#: the ``trace_format`` name Dynamo's ``run_trace_replay`` takes for each of ours
DYNAMO_FORMAT = {"dynamo-agentic": "agentic_mooncake", "mooncake": "mooncake"}


class UnsupportedTrace(UniRLError):
    """The trace holds semantics the chosen format cannot represent (listed in the message)."""


def _reject(fmt: str, problems: list[str]) -> None:
    if problems:
        shown = "\n  - ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise UnsupportedTrace(f"trace cannot be exported as '{fmt}' ({len(problems)} unsupported case(s)); "
                               f"nothing was approximated:\n  - {shown}")


def _by_batch(workload: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for w in workload:
        out.setdefault(int(w["batch"]), []).append(w)
    return out


def _common_problems(rows: list[dict[str, Any]], fmt: str, block_size: int) -> list[str]:
    problems = []
    seen: set[str] = set()
    for w in rows:
        p = w["parent_request_id"]
        if p is not None and p not in seen:
            problems.append(f"request {w['request_id']} depends on {p}, which is not earlier in its batch")
        if p is not None and w["wait_ms"] is None:
            problems.append(f"request {w['request_id']}: the wait after {p} was not measured; '{fmt}' needs a "
                            "delay and a missing wait is not a zero wait")
        if w["input_length"] > len(w["hash_ids"]) * block_size:
            problems.append(f"request {w['request_id']}: input_length {w['input_length']} exceeds its "
                            f"{len(w['hash_ids'])} hash blocks of {block_size} tokens")
        seen.add(w["request_id"])
    return problems


def export(fmt: str, manifest: dict[str, Any], workload: list[dict[str, Any]],
           problems: list[str] = (), arrivals: str = "observed") -> dict[int, str]:
    """``{batch index: file text}`` for ``fmt``; raises :class:`UnsupportedTrace` for what it cannot hold."""
    if fmt not in FORMATS:
        raise UnsupportedTrace(f"trace format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
    if arrivals not in ARRIVALS:
        raise UnsupportedTrace(f"arrivals {arrivals!r} is unknown; use one of {', '.join(ARRIVALS)}")
    if arrivals != "observed" and isinstance(manifest.get("stream"), dict):
        raise UnsupportedTrace(f"arrivals {arrivals!r}: this async / stream trace is one arrival stream with no batch "
                               "barrier; replay it with arrivals 'observed'")
    out: dict[int, str] = {}
    all_problems = list(problems)
    for b, rows in sorted(_by_batch(workload).items()):
        all_problems += _common_problems(rows, fmt, int(manifest["block_size"]))
        lines = (_agentic(manifest, rows, arrivals) if fmt == "dynamo-agentic"
                 else _mooncake(rows, all_problems, arrivals))
        out[b] = "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines)
    _reject(fmt, all_problems)
    return out


def first_arrival(w: dict[str, Any], arrivals: str) -> float:
    """Where a replay puts a first turn: its observed offset (0 in traces written before it existed)."""
    return float(w.get("arrival_ms") or 0.0) if arrivals == "observed" else 0.0


def _agentic(manifest: dict[str, Any], rows: list[dict[str, Any]], arrivals: str) -> list[dict[str, Any]]:
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
    header = {"schema": "dynamo.agentic_mooncake", "version": 2, "block_size": manifest["block_size"],
              "hash_id_scope": "local", "source": {"format": "unirl.rollout_trace", "digest": digest}}
    lines: list[dict[str, Any]] = [header]
    for w in rows:
        deps = []
        if w["parent_request_id"] is not None:
            deps = [{"request_id": w["parent_request_id"], "trigger": "completion",
                     "delay_ms": w["wait_ms"], "relation": "sequence"}]
        lines.append({"request_id": w["request_id"], "play_id": w["group_id"], "session_id": w["trajectory_id"],
                      "model": manifest["model_name"], "input_length": w["input_length"],
                      "output_length": w["output_length"], "hash_ids": w["hash_ids"],
                      "not_before_ms": first_arrival(w, arrivals) if not deps else 0,
                      "dependencies": deps})
    return lines


def _mooncake(rows: list[dict[str, Any]], problems: list[str], arrivals: str) -> list[dict[str, Any]]:
    children = Counter(w["parent_request_id"] for w in rows if w["parent_request_id"] is not None)
    session_of = {w["request_id"]: w["trajectory_id"] for w in rows}
    lines = []
    for w in rows:
        p = w["parent_request_id"]
        if children[w["request_id"]] > 1:
            problems.append(f"request {w['request_id']} is continued by {children[w['request_id']]} turns (a branch); "
                            "a mooncake session is one linear chain (use dynamo-agentic)")
        if p is not None and session_of.get(p) != w["trajectory_id"]:
            problems.append(f"request {w['request_id']} starts a branch from {p} in another trajectory; "
                            "mooncake has no cross-session dependency (use dynamo-agentic)")
        row = {"input_length": w["input_length"], "output_length": w["output_length"],
               "hash_ids": w["hash_ids"], "session_id": w["trajectory_id"]}
        if p is None:
            row["timestamp"] = first_arrival(w, arrivals)
        else:
            row["delay"] = w["wait_ms"]
        lines.append(row)
    return lines
