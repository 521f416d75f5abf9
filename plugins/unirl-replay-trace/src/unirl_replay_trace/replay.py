"""Replay a captured trace with Dynamo and compare the prediction with what was measured.

Each rollout batch is replayed on its own from t=0 (the batch barrier; see
:mod:`unirl_replay_trace.formats`) with ``dynamo.replay.run_trace_replay``. The predictor reads
only the exported batch files, built from the workload; the measured outcomes are read here, after
the replay, to join by request id. Times on both sides are ms from the batch barrier.

Four quantities, kept distinct:

* **TTFT** and **end-to-end latency** per request (arrival -> first token / finish);
* **GRPO group completion**: when the last request of a group finishes (the group's advantages can
  be computed);
* **batch readiness**: when the last request of the batch finishes (a synchronous step can train).

A ``mooncake`` replay reports random uuids instead of request ids, so nothing can be joined: the report
is then **aggregate-only** (means of what Dynamo summarised against means of what was measured), and
nothing is reconstructed from percentiles.

The default timing model of the Dynamo mocker is not calibrated to this hardware; the report says so.
With ``fit`` (timing-model parameters and candidate values, e.g. ``speedup_ratio``), the values are
chosen on the calibration batches (the first half, in capture order) and evaluated on the held-out
batches (the rest); the two errors are reported separately.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import statistics
from importlib import metadata
from pathlib import Path
from typing import Any

from unirl.api import ConfigError, UniRLError
from unirl_replay_trace import step_table
from unirl_replay_trace.capture import READABLE_SCHEMA_VERSIONS, SCHEMA, SCHEMA_VERSION
from unirl_replay_trace.exporter import TRACE_DIR, write_export
from unirl_replay_trace.fleet import Fleet, replay_args, whatif_summary
from unirl_replay_trace.formats import ARRIVALS, DYNAMO_FORMAT, DYNAMO_VALIDATED, FORMATS, export
from unirl_replay_trace.output import (  # noqa: F401 - re-exported: the report's text and plot
    PLOT_MARK,
    log_diagonal,
    plot,
    pyplot,
    render,
    save_png,
)
from unirl_replay_trace.schedule import refusal, refuse
from unirl_replay_trace.stream_trace import is_stream, stream_summary, stream_view

log = logging.getLogger(__name__)

UNCALIBRATED = ("The timing model is Dynamo's default mocker model, NOT calibrated to the hardware that "
                "produced this trace: read predicted-vs-measured as a functional check of the workload "
                "mapping, not as a performance forecast.")
#: ``kind`` of every report ``unirl trace replay`` writes (how a later run knows it may replace one)
REPORT_KIND = "unirl.trace_replay_report"
DYNAMO_INSTALL = "pip install ai-dynamo-runtime==1.6.1 && pip install --no-deps ai-dynamo==1.6.1"


# ------------------------------------------------------------------------------------- loading


def trace_dir(path: str | Path) -> Path:
    """A run directory or its ``trace/`` directory -> the trace directory (checked)."""
    p = Path(path)
    if (p / TRACE_DIR / "manifest.json").is_file():
        p = p / TRACE_DIR
    if not (p / "manifest.json").is_file():
        raise ConfigError(f"{path}: no trace here (expected {TRACE_DIR}/manifest.json in a run directory "
                          "written with trace.exporter set to dynamo-agentic or mooncake)")
    return p


#: what a trace file that cannot be read needs: the exporter writes the whole directory at close
RECAPTURE = ("capture the trace again: train with trace.exporter=dynamo-agentic (or mooncake) and rollout.mode=sync; "
             "the exporter writes the trace directory when training ends")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of one trace file; a missing file or a line that is not a JSON object is a
    :class:`ConfigError` naming the file and the line (a copy cut short, an edit), never a traceback."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read this trace file ({_why(exc)}) (fix: {RECAPTURE})") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{path}: line {n} is not valid JSON ({exc}; truncated?) (fix: {RECAPTURE})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}: line {n} is a JSON {_json_name(row)}, not an object (fix: {RECAPTURE})")
        rows.append(row)
    return rows


#: manifest fields the replay reads: their Python type and JSON name
_MANIFEST_FIELDS: dict[str, tuple[type, str]] = {
    "exporter": (str, "a string"), "batches": (list, "a list"), "block_size": (int, "an integer"),
    "model_name": (str, "a string"), "provenance": (dict, "an object")}


def read_manifest(d: Path) -> dict[str, Any]:
    """``d/manifest.json``, checked: readable JSON, an object, this schema, the fields the replay reads.

    Why so careful: a manifest cut short (a copy interrupted, a full disk) used to end
    ``unirl trace replay`` in a ``JSONDecodeError`` traceback that named neither the file nor a fix."""
    path = d / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable trace manifest ({_why(exc)}; truncated?) (fix: {RECAPTURE})") from None
    if not isinstance(manifest, dict):
        raise ConfigError(f"{path}: a JSON {_json_name(manifest)}, not a trace manifest (an object) "
                          f"(fix: {RECAPTURE})")
    if manifest.get("schema") != SCHEMA or manifest.get("schema_version") not in READABLE_SCHEMA_VERSIONS:
        raise ConfigError(f"{path}: schema {manifest.get('schema')!r} version "
                          f"{manifest.get('schema_version')!r}; this tool reads {SCHEMA!r} versions "
                          f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))} (writes {SCHEMA_VERSION}) "
                          f"(fix: replay it with the unirl-replay-trace that wrote it, or {RECAPTURE})")
    for key, (kind, name) in _MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            got = "missing" if key not in manifest else f"a JSON {_json_name(manifest[key])}"
            raise ConfigError(f"{path}: field {key!r} is {got}, expected {name} (fix: {RECAPTURE})")
    bad = [i for i, b in enumerate(manifest["batches"])
           if not isinstance(b, dict) or not isinstance(b.get("batch"), int) or not isinstance(b.get("requests"), int)]
    if bad:
        raise ConfigError(f"{path}: batches[{bad[0]}] lacks an integer 'batch' or 'requests' (fix: {RECAPTURE})")
    return manifest


def _json_name(v: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


def _why(exc: Exception) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def load(path: str | Path) -> tuple[Path, dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    d = trace_dir(path)
    manifest = read_manifest(d)
    # an async / stream trace is read as one replay unit on one clock (sync traces: unchanged)
    return d, *stream_view(manifest, read_jsonl(d / "workload.jsonl"), read_jsonl(d / "outcomes.jsonl"))


# ------------------------------------------------------------------------------------- measured


def measured_requests(outcomes: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for o in outcomes:
        if o["kind"] != "request" or o["finished_ms"] is None or o["submitted_ms"] is None:
            continue
        first = o["first_token_ms"]
        out[o["request_id"]] = {"arrival": o["submitted_ms"], "first_token": first, "terminal": o["finished_ms"],
                                "ttft": None if first is None else first - o["submitted_ms"],
                                "e2e": o["finished_ms"] - o["submitted_ms"]}
    return out


def occupancy(workload: list[dict[str, Any]], outcomes: list[dict[str, Any]], batch: int) -> dict[str, int]:
    """Measured peak of in-flight requests, occupied trajectory slots and occupied group slots in one batch.

    A trajectory holds its slot from its first submit to its last finish, tool waits included; a request
    is in flight only from its submit to its finish. So a trajectory waiting on a tool occupies a slot
    without being an in-flight request. Groups likewise (first submit to last finish of the group):
    Dynamo's ``agentic_lanes`` limits concurrent ``play_id``s, i.e. groups, and a lane stays held
    through tool waits, so a lane count is compared with the group peak, never the request peak."""
    times = {o["request_id"]: o for o in outcomes if o["kind"] == "request" and o["batch"] == batch}
    req_events: list[tuple[float, int]] = []
    spans: dict[str, dict[str, tuple[float, float]]] = {"trajectory_id": {}, "group_id": {}}
    for w in workload:
        o = times.get(w["request_id"])
        if w["batch"] != batch or o is None or o["submitted_ms"] is None or o["finished_ms"] is None:
            continue
        req_events += [(o["submitted_ms"], 1), (o["finished_ms"], -1)]
        for key, span in spans.items():
            lo, hi = span.get(w[key], (math.inf, -math.inf))
            span[w[key]] = (min(lo, o["submitted_ms"]), max(hi, o["finished_ms"]))

    def peak_of(span: dict[str, tuple[float, float]]) -> int:
        return _peak([e for lo, hi in span.values() for e in ((lo, 1), (hi, -1))])

    return {"max_in_flight_requests": _peak(req_events),
            "max_occupied_trajectory_slots": peak_of(spans["trajectory_id"]),
            "max_occupied_group_slots": peak_of(spans["group_id"])}


def _peak(events: list[tuple[float, int]]) -> int:
    cur = best = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):  # a finish at t frees before a submit at t
        cur += d
        best = max(best, cur)
    return best


# ------------------------------------------------------------------------------------- Dynamo version


class DynamoVersionSkew(UniRLError):
    """The installed Dynamo is not the release the trace's replay files were validated with."""


#: the distributions whose version must match (the Python package and its Rust runtime)
DYNAMO_DISTS = ("ai-dynamo", "ai-dynamo-runtime")


def installed_dynamo() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in DYNAMO_DISTS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def check_dynamo_version(manifest: dict[str, Any], *, allow_skew: bool = False) -> str | None:
    """Compare the installed Dynamo with the release the trace format was validated with.

    Why at replay and not only at install: the replay files lean on details that have moved between
    Dynamo releases (``agentic_mooncake`` v2, engine args nested under ``engine``, per-request
    results with our request ids). A different release can parse the same file and silently predict
    something else. A mismatch raises :class:`DynamoVersionSkew` naming both versions and the fix;
    with ``allow_skew`` it is a warning, returned so the report records it. Not installed: ``None``
    here (the replay itself names the install command)."""
    validated = str((manifest.get("dynamo") or {}).get("validated") or DYNAMO_VALIDATED)
    found = {d: v for d, v in installed_dynamo().items() if v is not None}
    skewed = {d: v for d, v in found.items() if v != validated}
    if not skewed:
        return None
    got = ", ".join(f"{d} {v}" for d, v in sorted(skewed.items()))
    msg = (f"installed {got}, but this trace's replay format was validated with Dynamo {validated} "
           "(agentic_mooncake v2, engine args under 'engine', per-request results joined by request id); "
           "another release may read the same files and predict something else")
    if not allow_skew:
        raise DynamoVersionSkew(f"{msg}. Fix: pip install ai-dynamo-runtime=={validated} && pip install --no-deps "
                                f"ai-dynamo=={validated}, or pass --allow-version-skew to replay anyway (the report "
                                "then records the skew)")
    log.warning("trace replay: %s (--allow-version-skew)", msg)
    return msg


# ------------------------------------------------------------------------------------- replay


def _dynamo():
    try:
        from dynamo.replay import run_trace_replay
    except ImportError as exc:
        raise UniRLError(f"`unirl trace replay` needs Dynamo's replay ({exc}); install it with: {DYNAMO_INSTALL}"
                         " (plain `pip install ai-dynamo` fails: its aisimulate dependency is a stub)") from exc
    return run_trace_replay


def replay_batch(path: Path, fmt: str, manifest: dict[str, Any], params: dict[str, Any] | None = None,
                 lanes: int | None = None, fleet: Fleet | None = None) -> dict[str, Any]:
    """One batch file through ``run_trace_replay``; returns ``ReplayReport.to_dict()``. The engine's
    known scheduling limits, a what-if ``fleet`` and the timing ``params`` (:func:`fleet.replay_args`)."""
    run_trace_replay = _dynamo()
    bs = int(manifest["block_size"])
    kwargs: dict[str, Any] = dict(trace_format=DYNAMO_FORMAT[fmt], trace_block_size=bs, capture_per_request=True,
                                  **replay_args(manifest, fleet, params))
    if fmt == "dynamo-agentic":
        kwargs["execution_model"] = manifest["model_name"]
        kwargs["agentic_lanes"] = lanes
    return run_trace_replay(str(path), **kwargs).to_dict()


def replay_all(d: Path, manifest: dict[str, Any], workload: list[dict[str, Any]], fmt: str,
               batches: list[int], params: dict[str, Any] | None = None,
               lanes: int | None = None, arrivals: str = "observed",
               fleet: Fleet | None = None) -> dict[int, dict[str, Any]]:
    """Replay ``batches``. The exporter wrote ``<fmt>/`` with observed arrivals; barrier arrivals (or a
    trace captured with the other exporter) are exported here first, into ``<fmt>-barrier/``."""
    if arrivals not in ARRIVALS:
        raise ConfigError(f"--arrivals {arrivals!r}: use one of {', '.join(ARRIVALS)}")
    sub = fmt if arrivals == "observed" else f"{fmt}-{arrivals}"
    files = sorted((d / sub).glob("batch-*.jsonl"))
    if not files or sub != fmt:  # rejections raise here; derived files are rebuilt (never stale: cheap)
        write_export(d, fmt, export(fmt, manifest, workload, arrivals=arrivals), sub=sub)
    return {b: replay_batch(d / sub / f"batch-{b:04d}.jsonl", fmt, manifest, params, lanes, fleet) for b in batches}


def cache_states(manifest: dict[str, Any], batches: list[int]) -> list[dict[str, Any]]:
    """Each batch's initial prefix-cache state as captured; ``cold_start_mismatch`` where the engine
    started warm (a Dynamo replay always starts with an empty cache, so its prefill is pessimistic there)."""
    by = {b["batch"]: b for b in manifest["batches"]}
    out = []
    for b in batches:
        st = dict(by.get(b, {}).get("initial_cache") or {"state": "unknown"})
        out.append({"batch": b, **st, "cold_start_mismatch": st.get("state") == "warm"})
    return out


def wait_split(workload: list[dict[str, Any]], batches: list[int]) -> list[dict[str, Any]]:
    """Per batch: the external waits between turns, split into tool time and controller overhead
    where the controller measured tool time (``tool_ms``); the replay's delays are the whole waits."""
    out = []
    for b in batches:
        rows = [w for w in workload if w["batch"] == b and w.get("wait_ms") is not None]
        split = [w for w in rows if w.get("tool_ms") is not None]
        out.append({"batch": b, "waits": len(rows), "wait_ms_total": round(sum(w["wait_ms"] for w in rows), 3),
                    "with_tool_time": len(split),
                    "tool_ms_total": round(sum(w["tool_ms"] for w in split), 3),
                    "overhead_ms_total": round(sum(w["overhead_ms"] for w in split), 3)})
    return out


# ------------------------------------------------------------------------------------- compare


def _stats(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    if not pairs:
        return {"n": 0}
    meas, pred = [m for m, _ in pairs], [p for _, p in pairs]
    ratios = [p / m for m, p in pairs if m > 0 and p > 0]
    return {"n": len(pairs), "measured_mean_ms": statistics.fmean(meas), "predicted_mean_ms": statistics.fmean(pred),
            "measured_p50_ms": statistics.median(meas), "predicted_p50_ms": statistics.median(pred),
            "mean_abs_error_ms": statistics.fmean(abs(p - m) for m, p in pairs),
            "mean_ratio_predicted_over_measured": statistics.fmean(ratios) if ratios else None,
            "mean_abs_log_ratio": statistics.fmean(abs(math.log(r)) for r in ratios) if ratios else None}


def compare(workload: list[dict[str, Any]], outcomes: list[dict[str, Any]],
            predictions: dict[int, dict[str, Any]], fmt: str) -> dict[str, Any]:
    """Join per request (``dynamo-agentic``) or compare aggregates (``mooncake``)."""
    measured = measured_requests(outcomes)
    rows = [w for w in workload if w["batch"] in predictions]
    if fmt == "mooncake":
        return _aggregate_only(rows, measured, predictions)
    per_request, missing = [], []
    groups: dict[tuple[int, str], list[tuple[float, float]]] = {}
    batch_ready: dict[int, list[tuple[float, float]]] = {}
    for b, rep in predictions.items():
        pred = {r["request_id"]: r for r in rep["per_request"] or []}
        for w in (w for w in rows if w["batch"] == b):
            p, m = pred.get(w["request_id"]), measured.get(w["request_id"])
            if p is None:
                missing.append(w["request_id"])
                continue
            row = {"request_id": w["request_id"], "batch": b, "group_id": w["group_id"], "turn": w["turn"],
                   "predicted": {"arrival": p["arrival_time_ms"], "ttft": p["ttft_ms"], "e2e": p["e2e_latency_ms"],
                                 "terminal": p["terminal_time_ms"]},
                   "measured": m}
            per_request.append(row)
            if m is not None:
                groups.setdefault((b, w["group_id"]), []).append((m["terminal"], p["terminal_time_ms"]))
                batch_ready.setdefault(b, []).append((m["terminal"], p["terminal_time_ms"]))
    if missing:
        raise UniRLError(f"the replay returned no result for {len(missing)} request(s), e.g. {missing[:3]}")
    group_rows = [{"batch": b, "group_id": g, "measured_ms": max(m for m, _ in v), "predicted_ms": max(p for _, p in v)}
                  for (b, g), v in sorted(groups.items())]
    batch_rows = [{"batch": b, "measured_ms": max(m for m, _ in v), "predicted_ms": max(p for _, p in v)}
                  for b, v in sorted(batch_ready.items())]
    joined = [r for r in per_request if r["measured"] is not None]
    return {
        "mode": "per-request", "format": fmt, "requests": len(per_request),
        "per_request": per_request, "group_completion": group_rows, "batch_readiness": batch_rows,
        "aggregate": {
            "ttft": _stats([(r["measured"]["ttft"], r["predicted"]["ttft"]) for r in joined
                            if r["measured"]["ttft"] is not None]),
            "e2e": _stats([(r["measured"]["e2e"], r["predicted"]["e2e"]) for r in joined]),
            "group_completion": _stats([(g["measured_ms"], g["predicted_ms"]) for g in group_rows]),
            "batch_readiness": _stats([(b["measured_ms"], b["predicted_ms"]) for b in batch_rows]),
        },
    }


def _aggregate_only(rows: list[dict[str, Any]], measured: dict[str, dict[str, float]],
                    predictions: dict[int, dict[str, Any]]) -> dict[str, Any]:
    agg: dict[str, list[tuple[float, float]]] = {"ttft": [], "e2e": [], "batch_readiness": []}
    for b, rep in predictions.items():
        s = rep["summary"]
        ms = [measured[w["request_id"]] for w in rows if w["batch"] == b and w["request_id"] in measured]
        if not ms:
            continue
        ttfts = [m["ttft"] for m in ms if m["ttft"] is not None]
        if ttfts and s.get("mean_ttft_ms") is not None:
            agg["ttft"].append((statistics.fmean(ttfts), s["mean_ttft_ms"]))
        if s.get("mean_e2e_latency_ms") is not None:
            agg["e2e"].append((statistics.fmean(m["e2e"] for m in ms), s["mean_e2e_latency_ms"]))
        agg["batch_readiness"].append((max(m["terminal"] for m in ms), s["duration_ms"]))
    return {
        "mode": "aggregate-only", "format": "mooncake", "requests": len(rows),
        "why": "mooncake replay results carry random uuids, not request ids: no per-request join is possible, "
               "so only per-batch means (Dynamo's summary) are compared; nothing is reconstructed from percentiles, "
               "and GRPO group completion is not available",
        "per_request": [], "group_completion": [],
        "batch_readiness": [{"batch": b, "measured_ms": m, "predicted_ms": p}
                            for b, (m, p) in zip(sorted(predictions), agg["batch_readiness"], strict=False)],
        "aggregate": {"ttft_batch_mean": _stats(agg["ttft"]), "e2e_batch_mean": _stats(agg["e2e"]),
                      "group_completion": {"n": 0, "note": "not available in aggregate-only mode"},
                      "batch_readiness": _stats(agg["batch_readiness"])},
    }


def _error(report: dict[str, Any]) -> float:
    """What a fit minimises: mean |log(predicted / measured)| of per-request e2e (batch readiness when
    only aggregates exist)."""
    key = "e2e" if report["mode"] == "per-request" else "batch_readiness"
    v = report["aggregate"][key].get("mean_abs_log_ratio")
    return math.inf if v is None else v


def parse_fit(items: list[str]) -> dict[str, list[Any]]:
    """``["speedup_ratio=0.5,1,2"]`` -> ``{"speedup_ratio": [0.5, 1.0, 2.0]}`` (numbers where they parse)."""
    out: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        vals = [v for v in values.split(",") if v.strip()]
        if not sep or not key.strip() or not vals:
            raise ConfigError(f"--fit {item!r}: write KEY=V1,V2,... (a Dynamo mocker engine arg, e.g. "
                              "speedup_ratio=0.5,1,2)")
        out[key.strip()] = [_num(v.strip()) for v in vals]
    return out


def _num(v: str) -> Any:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def prepare(path: str | Path, fmt: str | None, *, allow_version_skew: bool = False,
            arrivals: str = "observed") -> tuple[Path, dict[str, Any], list[dict[str, Any]], list[dict[str, Any]],
                                                 str, list[int], str | None]:
    """Everything checked before the first replay: the trace, the format, the arrivals, the Dynamo
    version. Returns ``(dir, manifest, workload, outcomes, fmt, batches, version_skew_warning)``."""
    d, manifest, workload, outcomes = load(path)
    fmt = fmt or manifest["exporter"]
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    if arrivals not in ARRIVALS:
        raise ConfigError(f"--arrivals {arrivals!r}: use one of {', '.join(ARRIVALS)}")
    if manifest.get("rejected") and fmt == manifest["exporter"]:
        raise UniRLError(f"{d}/manifest.json: this trace was rejected at export:\n{manifest['rejected']}")
    batches = [b["batch"] for b in manifest["batches"] if b["requests"]]
    if not batches:
        raise UniRLError(f"{d}: the trace holds no requests")
    skew = check_dynamo_version(manifest, allow_skew=allow_version_skew)
    return d, manifest, workload, outcomes, fmt, batches, skew


def run(path: str | Path, *, fmt: str | None = None, fit: dict[str, list[Any]] | None = None,
        lanes: int | None = None, arrivals: str = "observed", allow_version_skew: bool = False,
        use_calibration: bool = True, fleet: Fleet | None = None) -> dict[str, Any]:
    """The whole ``unirl trace replay``: replay every batch, join, compare; with ``fit``, calibrate;
    with a what-if ``fleet``, also predict each batch at that fleet (``report["whatif"]``).

    Without ``fit``, a ``calibration.json`` that ``unirl trace calibrate`` left in the trace directory
    supplies the timing parameters, and the report names it with its held-out error; otherwise the
    report says the timing model is uncalibrated."""
    d, manifest, workload, outcomes, fmt, batches, skew = prepare(path, fmt, allow_version_skew=allow_version_skew,
                                                                  arrivals=arrivals)
    report: dict[str, Any] = {"kind": REPORT_KIND, "trace": str(d), "timing_model": "uncalibrated (Dynamo mocker default)",
                              "note": UNCALIBRATED, "batches": len(batches), "arrivals": arrivals,
                              "dynamo": {"validated": (manifest.get("dynamo") or {}).get("validated", DYNAMO_VALIDATED),
                                         "installed": installed_dynamo(), "version_skew": skew},
                              "initial_cache": cache_states(manifest, batches), "waits": wait_split(workload, batches),
                              "occupancy": [{"batch": b, **occupancy(workload, outcomes, b)} for b in batches]}
    if not fit:
        params = None
        cal = read_calibration(d) if use_calibration else None
        if cal is not None:
            params = {**(cal.get("engine_args_given") or {}), **cal["fitted"]}
            if cal.get("step_table"):  # the table next to this trace, wherever the run directory moved
                params["timing_model"] = step_table.timing_model(d / step_table.STEP_TABLE_FILE)
            report["timing_model"] = f"calibrated by `unirl trace calibrate`: {params}"
            report["note"] = calibrated_note(cal)
            report["calibration_file"] = str(d / CALIBRATION_FILE)
        report.update(compare(workload, outcomes, replay_all(d, manifest, workload, fmt, batches, params, lanes,
                                                             arrivals), fmt))
        if is_stream(manifest):  # an async / stream run: the run as a whole, per captured batch
            report["stream"] = stream_summary(manifest, workload, report)
        if refusal(manifest):
            refuse(report, refusal(manifest))
        if fleet is not None and fleet.is_whatif:
            alt = compare(workload, outcomes, replay_all(d, manifest, workload, fmt, batches, params, lanes,
                                                         arrivals, fleet), fmt)
            report["whatif"] = whatif_summary(report, alt, fleet, manifest)
        return report
    if fleet is not None and fleet.is_whatif:
        raise ConfigError("--fit with --workers / --engine / --router-mode: fit at the captured fleet first "
                          "(`unirl trace calibrate`), then ask the what-if question with the fitted parameters")
    if len(batches) < 2:
        raise ConfigError("--fit needs at least 2 rollout batches (calibration and held-out); this trace has "
                          f"{len(batches)}")
    cut = (len(batches) + 1) // 2
    calib, hold = batches[:cut], batches[cut:]
    candidates = [dict(zip(fit, vals, strict=True)) for vals in itertools.product(*fit.values())]
    scored = []
    for params in candidates:
        rep = compare(workload, outcomes, replay_all(d, manifest, workload, fmt, calib, params, lanes, arrivals), fmt)
        scored.append((_error(rep), params))
    best_err, best = min(scored, key=lambda x: x[0])
    held = compare(workload, outcomes, replay_all(d, manifest, workload, fmt, hold, best, lanes, arrivals), fmt)
    default = compare(workload, outcomes, replay_all(d, manifest, workload, fmt, hold, None, lanes, arrivals), fmt)
    report.update(refuse(held, refusal(manifest)) if refusal(manifest) else held)
    report["timing_model"] = f"fitted on calibration batches {calib}: {best}"
    report["note"] = (f"Timing parameters {best} were fitted on batches {calib}; the rows shown are the held-out "
                      f"batches {hold} only (error {_error(held):.3f}, mean |log(predicted/measured)|).")
    report["calibration"] = {
        "calibration_batches": calib, "holdout_batches": hold, "candidates": [
            {"params": p, "calibration_error": e} for e, p in scored],
        "chosen": best, "calibration_error": best_err, "holdout_error": _error(held),
        "holdout_error_default_params": _error(default),
        "error": "mean |log(predicted/measured)| of " + ("per-request e2e" if held["mode"] == "per-request"
                                                         else "batch readiness"),
        "note": "the reported rows and aggregates are the held-out batches only, with the chosen parameters",
    }
    return report


# ------------------------------------------------------------------------------------- calibration file

#: what ``unirl trace calibrate`` writes into the trace directory (read by ``unirl trace replay``)
CALIBRATION_FILE = "calibration.json"
CALIBRATION_KIND = "unirl.trace_calibration"


def read_calibration(d: Path) -> dict[str, Any] | None:
    """``d/calibration.json`` when ``unirl trace calibrate`` wrote one (a damaged one is an error naming it)."""
    path = d / CALIBRATION_FILE
    if not path.is_file():
        return None
    try:
        cal = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable calibration ({_why(exc)}); fix: run `unirl trace calibrate` "
                          "again, or delete the file to replay uncalibrated") from None
    if not isinstance(cal, dict) or cal.get("kind") != CALIBRATION_KIND or not isinstance(cal.get("fitted"), dict):
        raise ConfigError(f"{path}: not a calibration written by `unirl trace calibrate` (kind / fitted); fix: run "
                          "it again, or delete the file to replay uncalibrated")
    return cal


def calibrated_note(cal: dict[str, Any]) -> str:
    h = (cal.get("holdout") or {}).get("all") or {}
    e2e, mk = h.get("request_e2e") or {}, h.get("batch_makespan") or {}

    def pct(x: Any) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    return (f"Timing parameters {cal['fitted']} were fitted by `unirl trace calibrate` on batches "
            f"{cal.get('calibration_batches')}; on the held-out batches {cal.get('holdout_batches')} the median "
            f"absolute percentage error was {pct(e2e.get('median_ape'))} for request e2e (p90 "
            f"{pct(e2e.get('p90_ape'))}) and {pct(mk.get('median_ape'))} for batch makespan. Batches used for "
            "fitting predict better than that.")
