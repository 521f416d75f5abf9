"""``unirl trace calibrate RUN``: how far is a replay's prediction from what happened, measured honestly.

Dynamo's mocker times prefill and decode with a default model that knows nothing of the hardware that
produced the trace. Its engine-speed parameters can be fitted to a captured run, but an error measured
on the batches used for fitting says little about a batch the replay has not seen. So:

* the batches of the trace are split **alternately within each rollout phase** (a phase's 1st, 3rd, ...
  batch fit; its 2nd, 4th, ... are held out): both halves span the whole run (early and late training,
  train and eval batches), so the held-out error is not confounded with the policy's drift, and no
  held-out batch is read by the fit;
* the fitted parameters are the mocker's two engine-speed knobs (:data:`PARAMS`): ``speedup_ratio``
  (divides prefill and decode time) and ``decode_speedup_ratio`` (divides decode time only). They are
  searched on a log grid, coarse then fine (:func:`fit`), minimising the median |log(predicted /
  measured)| of per-request end-to-end latency over the fitting batches (symmetric in over- and
  under-prediction, and robust to a few outliers);
* on the held-out batches the fitted replay and the default one are both compared with the
  measurements: median and p90 absolute percentage error of per-request e2e, per-request TTFT (where
  measured) and batch makespan (batch readiness: the last finish from the barrier), per rollout phase
  (train, eval) and overall, and what that error is made of (:mod:`unirl_replay_trace.error_split`).

The result goes to ``calibration.json`` in the trace directory, which ``unirl trace replay`` then uses
(its report stops saying "uncalibrated" and quotes the held-out error), and a scatter plot PNG.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

from unirl.api import ConfigError, atomic_write_json
from unirl_replay_trace import step_table as steps
from unirl_replay_trace.error_split import error_split, render_split
from unirl_replay_trace.fleet import known_engine_args
from unirl_replay_trace.output import log_diagonal, pyplot, save_png, scatter_positive
from unirl_replay_trace.replay import (
    CALIBRATION_KIND,
    compare,
    installed_dynamo,
    prepare,
    replay_all,
)
from unirl_replay_trace.schedule import makespan_objective, refusal, refuse, schedule_note

#: the Dynamo mocker engine arguments fitted (both divide modelled time: larger is faster)
PARAMS = ("speedup_ratio", "decode_speedup_ratio")
PLOT_MARK = "unirl trace calibrate plot"
QUANTITIES = ("request_e2e", "request_ttft", "batch_makespan")


def split(batches: list[int], phase_of: dict[int, str] | None = None) -> tuple[list[int], list[int]]:
    """Alternate within each rollout phase: a phase's 1st, 3rd, ... batch fit, its 2nd, 4th, ... are held
    out (see the module doc). Per phase, so eval batches (every k-th) land on both sides."""
    seen: dict[str, int] = {}
    fit_, hold = [], []
    for b in batches:
        ph = (phase_of or {}).get(b, "")
        (fit_ if seen.get(ph, 0) % 2 == 0 else hold).append(b)
        seen[ph] = seen.get(ph, 0) + 1
    return fit_, hold


def _pairs(rep: dict[str, Any], phase_of: dict[int, str]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """``{phase: {quantity: [(measured, predicted), ...]}}`` with ``phase`` also ``"all"``."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}

    def add(phase: str, q: str, m: float | None, p: float | None) -> None:
        if m is None or p is None or m <= 0 or p <= 0:
            return
        for ph in (phase, "all"):
            out.setdefault(ph, {k: [] for k in QUANTITIES})[q].append((float(m), float(p)))

    for r in rep["per_request"]:
        m = r["measured"]
        if m is None:
            continue
        ph = phase_of.get(r["batch"], "?")
        add(ph, "request_e2e", m["e2e"], r["predicted"]["e2e"])
        add(ph, "request_ttft", m["ttft"], r["predicted"]["ttft"])
    for b in rep["batch_readiness"]:
        add(phase_of.get(b["batch"], "?"), "batch_makespan", b["measured_ms"], b["predicted_ms"])
    return out


def _p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(0.9 * len(s)) - 1))]  # nearest rank


def errors(rep: dict[str, Any], phase_of: dict[int, str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Median / p90 absolute percentage error per phase and quantity (fractions: 0.25 is 25 %)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for ph, qs in _pairs(rep, phase_of).items():
        out[ph] = {}
        for q, pairs in qs.items():
            apes = [abs(p - m) / m for m, p in pairs]
            out[ph][q] = {"n": len(pairs)} if not apes else {
                "n": len(pairs), "median_ape": statistics.median(apes), "p90_ape": _p90(apes),
                "median_ratio_predicted_over_measured": statistics.median(p / m for m, p in pairs)}
    return out


def objective(rep: dict[str, Any]) -> float:
    """Median |log(predicted / measured)| of per-request e2e (what the fit minimises)."""
    logs = [abs(math.log(r["predicted"]["e2e"] / r["measured"]["e2e"])) for r in rep["per_request"]
            if r["measured"] and r["measured"]["e2e"] > 0 and r["predicted"]["e2e"] and r["predicted"]["e2e"] > 0]
    return statistics.median(logs) if logs else math.inf


def fit(score) -> tuple[dict[str, float], float, list[dict[str, Any]]]:
    """Coarse-to-fine log-grid search over :data:`PARAMS`; ``score(params) -> error``.

    Stage 1: ``speedup_ratio`` over 1e-3 .. 1e3 (quarter decades), decode at 1. Stage 2: around the
    best, ``speedup_ratio`` x 2^(-1..1 by 1/2) and ``decode_speedup_ratio`` 2^(-3..3). Stage 3: both
    x 2^(-1/4, 0, 1/4) around the best. About 70 points; each is one replay of every fitting batch."""
    tried: list[dict[str, Any]] = []

    def run(p: dict[str, float]) -> float:
        key = {k: float(f"{v:.6g}") for k, v in p.items()}
        for t in tried:
            if t["params"] == key:
                return t["error"]
        e = score(key)
        tried.append({"params": key, "error": e})
        return e

    best = min(({"speedup_ratio": 10 ** (k / 4), "decode_speedup_ratio": 1.0} for k in range(-12, 13)), key=run)
    s0 = best["speedup_ratio"]
    best = min(({"speedup_ratio": s0 * 2 ** (i / 2), "decode_speedup_ratio": 2.0 ** j}
                for i in range(-2, 3) for j in range(-3, 4)), key=run)
    s0, d0 = best["speedup_ratio"], best["decode_speedup_ratio"]
    best = min(({"speedup_ratio": s0 * 2 ** (i / 4), "decode_speedup_ratio": d0 * 2 ** (j / 4)}
                for i in (-1, 0, 1) for j in (-1, 0, 1)), key=run)
    chosen = min(tried, key=lambda t: t["error"])
    return chosen["params"], chosen["error"], tried


def calibrate(path: str | Path, *, fmt: str | None = None, arrivals: str = "observed", lanes: int | None = None,
              allow_version_skew: bool = False, engine: dict[str, Any] | None = None,
              step_table: bool = False) -> dict[str, Any]:
    """Fit on half the batches, measure on the other half (see the module doc); the calibration document.
    ``engine``: scheduler facts of the captured engine that the trace did not record (mocker argument
    names, :data:`unirl_replay_trace.fleet.ENGINE_KNOBS`), passed in every replay and kept in the file.
    ``step_table``: also fit the mocker's step-cost table on the fitting batches
    (:mod:`unirl_replay_trace.step_table`), written next to the trace and replayed with from then on."""
    t0 = time.perf_counter()
    d, manifest, workload, outcomes, fmt, batches, skew = prepare(path, fmt, allow_version_skew=allow_version_skew,
                                                                  arrivals=arrivals)
    if fmt != "dynamo-agentic":
        raise ConfigError(f"--format {fmt}: calibration compares per-request latency, which only a dynamo-agentic "
                          "replay can join (mooncake results carry random uuids); use --format dynamo-agentic")
    if len(batches) < 2:
        raise ConfigError(f"{d}: calibration needs at least 2 rollout batches (one to fit, one held out); this "
                          f"trace has {len(batches)}; capture more steps (trainer.steps)")
    phase_of = {b["batch"]: b.get("phase", "?") for b in manifest["batches"]}
    calib, hold = split(batches, phase_of)
    if not hold:
        raise ConfigError(f"{d}: no batch left to hold out (each phase needs 2 batches); capture more steps")
    table = _step_table(d, workload, outcomes, calib) if step_table else None
    if table is not None:
        engine = {**(engine or {}), "timing_model": steps.timing_model(d / steps.STEP_TABLE_FILE)}

    def replay(bs: list[int], params: dict[str, float] | None) -> dict[str, Any]:
        rep = compare(workload, outcomes, replay_all(d, manifest, workload, fmt, bs, {**(engine or {}), **(params or {})},
                                                     lanes, arrivals), fmt)
        return refuse(rep, refused, keep_rows=False) if refused else rep

    refused = refusal(manifest)
    objective_of = makespan_objective if refused else objective
    fitted, fit_error, tried = fit(lambda p: objective_of(replay(calib, p)))
    held, held_default = replay(hold, fitted), replay(hold, None)
    on_fit = replay(calib, fitted)
    return {
        "kind": CALIBRATION_KIND, "trace": str(d), "created_unix_ms": round(time.time() * 1000.0, 3),
        "format": fmt, "arrivals": arrivals, "lanes": lanes,
        "dynamo": {"installed": installed_dynamo(), "version_skew": skew},
        "parameters_fitted": list(PARAMS), "fitted": fitted,
        "objective": f"median |log(predicted/measured)| of {'batch makespan' if refused else 'per-request e2e'} "
                     "on the fitting batches",
        "schedule": schedule_note(manifest), "per_request_refused": refused,
        "split": "alternate within each phase: a phase's 1st, 3rd, ... batch fit, its 2nd, 4th, ... held out",
        "max_num_seqs": (manifest["provenance"].get("engine") or {}).get("max_num_seqs"),
        "engine_args": {**known_engine_args(manifest), **(engine or {})},
        "engine_args_given": dict(engine or {}), "step_table": table,
        "calibration_batches": calib, "holdout_batches": hold,
        "fit_objective": fit_error, "holdout_objective": objective_of(held),
        "holdout_objective_default_params": objective_of(held_default),
        "grid_points": len(tried), "search": tried,
        "holdout": errors(held, phase_of), "holdout_default_params": errors(held_default, phase_of),
        "fitting_batches": errors(on_fit, phase_of), "error_split": error_split(held, on_fit, phase_of),
        "points": {"holdout_fitted": _points(held), "holdout_default": _points(held_default)},
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _step_table(d: Path, workload: list[dict[str, Any]], outcomes: list[dict[str, Any]],
                calib: list[int]) -> dict[str, float]:
    """The step-cost table of the fitting batches, written to ``d``; a capture that shows none is refused."""
    try:
        table = steps.fit(workload, outcomes, calib)
    except ValueError as exc:
        raise ConfigError(f"--step-table: {exc}; calibrate without --step-table") from None
    steps.write(table, d / steps.STEP_TABLE_FILE)
    return table


def _points(rep: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    return {"request_e2e": [(r["measured"]["e2e"], r["predicted"]["e2e"]) for r in rep["per_request"] if r["measured"]],
            "batch_makespan": [(b["measured_ms"], b["predicted_ms"]) for b in rep["batch_readiness"]]}


def render(cal: dict[str, Any]) -> str:
    def pct(x: Any) -> str:
        return "  n/a " if x is None else f"{100 * x:5.1f}%"

    lines = [f"trace calibration of {cal['trace']} ({cal['arrivals']} arrivals)",
             f"  fitted {', '.join(cal['parameters_fitted'])} on batches {cal['calibration_batches']} "
             f"({cal['grid_points']} grid points): {cal['fitted']}",
             f"  objective ({cal['objective']}): fitting {cal['fit_objective']:.3f}, held-out "
             f"{cal['holdout_objective']:.3f} (default params {cal['holdout_objective_default_params']:.3f})",
             f"  held-out batches {cal['holdout_batches']}: absolute percentage error, fitted (default params)"]
    for ph, qs in sorted(cal["holdout"].items()):
        for q in QUANTITIES:
            e, dflt = qs.get(q) or {}, (cal["holdout_default_params"].get(ph) or {}).get(q) or {}
            if not e.get("n"):
                continue
            lines.append(f"    {ph:<6} {q:<15} n={e['n']:<5} median {pct(e.get('median_ape'))} "
                         f"({pct(dflt.get('median_ape'))})  p90 {pct(e.get('p90_ape'))} ({pct(dflt.get('p90_ape'))})")
    if cal.get("step_table"):
        t = cal["step_table"]
        lines.append(f"  step-cost table (fitting batches): prefill {t['prefill_ms_per_prompt_token']:.4g} ms/prompt token, "
                     f"decode step {t['decode_step_ms']:.4g} ms + {t['decode_ms_per_active_kv_token']:.3g} ms/active KV token")
    lines += render_split(cal.get("error_split"))
    h = cal["holdout"].get("all", {}).get("request_e2e", {})
    if cal.get("per_request_refused"):
        mk = cal["holdout"].get("all", {}).get("batch_makespan", {})
        lines.append(f"  {cal['per_request_refused']}")
        lines.append(f"  held-out median error (batch makespan): {pct(mk.get('median_ape')).strip()}")
        return "\n".join(lines)
    lines.append(f"  held-out median error (request e2e): {pct(h.get('median_ape')).strip()}, "
                 f"p90 {pct(h.get('p90_ape')).strip()}")
    return "\n".join(lines)


def plot(cal: dict[str, Any], path: Path) -> Path | None:
    """Held-out predicted against measured (log-log), fitted and default parameters; None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, q in zip(axes, ("request_e2e", "batch_makespan"), strict=True):
        vals: list[float] = []
        for key, label, marker in (("holdout_default", "default params", "x"), ("holdout_fitted", "fitted", "o")):
            vals += scatter_positive(ax, cal["points"][key][q], marker=marker, alpha=0.5, label=label, s=12)
        log_diagonal(ax, vals)
        ax.set_xlabel("measured (ms)")
        ax.set_ylabel("predicted by Dynamo replay (ms)")
        ax.set_title(f"held-out {q.replace('_', ' ')}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"fitted {cal['fitted']}", fontsize=8)
    fig.tight_layout()
    return save_png(plt, fig, path, PLOT_MARK)


def write(cal: dict[str, Any], path: Path) -> None:
    atomic_write_json(path, cal, indent=2)
