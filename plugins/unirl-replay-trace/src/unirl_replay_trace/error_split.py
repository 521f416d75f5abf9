"""What a calibration's held-out error is made of: the schedule's shape, or the batch's speed.

Why: one speed fitted for a whole run cannot follow a machine whose speed changes from batch to batch
(other jobs on shared cores). Two figures separate the two, both from the held-out replay and the
measurements alone:

* ``shape_only_request_e2e_median_ape``: each held-out batch's predictions rescaled by that batch's own
  best factor (the median of measured / predicted e2e), then the median absolute percentage error. What is
  left is the error in the *order and spacing* of finishes inside a batch, the part of the schedule the
  mocker models; the rest of the fitted error is the batch's speed.
* ``makespan_spread``: per rollout phase, the measured makespans of every batch (in a fixed recipe the batches of a
  phase have one request shape), and the held-out median error of the best speed-blind
  predictor: the median makespan of the fitting batches of that phase. A replay whose timing parameters
  are constant across batches cannot do much better than that on batches of one shape.
"""

from __future__ import annotations

import statistics
from typing import Any


def _ape(m: float, p: float) -> float:
    return abs(p - m) / m


def shape_only(held: dict[str, Any]) -> float | None:
    by: dict[int, list[tuple[float, float]]] = {}
    for r in held["per_request"]:
        m, p = (r["measured"] or {}).get("e2e"), r["predicted"]["e2e"]
        if m and p and m > 0 and p > 0:
            by.setdefault(r["batch"], []).append((m, p))
    apes = []
    for pairs in by.values():
        k = statistics.median(m / p for m, p in pairs)
        apes += [_ape(m, p * k) for m, p in pairs]
    return statistics.median(apes) if apes else None


def makespan_spread(held: dict[str, Any], fitting: dict[str, Any], phase_of: dict[int, str]) -> dict[str, Any]:
    fit_by: dict[str, list[float]] = {}
    for b in fitting["batch_readiness"]:
        fit_by.setdefault(phase_of.get(b["batch"], "?"), []).append(b["measured_ms"])
    out: dict[str, Any] = {}
    for b in held["batch_readiness"]:
        ph = phase_of.get(b["batch"], "?")
        row = out.setdefault(ph, {"measured_ms": sorted(fit_by.get(ph, [])), "apes": []})
        row["measured_ms"] = sorted([*row["measured_ms"], b["measured_ms"]])
        if fit_by.get(ph) and b["measured_ms"] > 0:
            row["apes"].append(_ape(b["measured_ms"], statistics.median(fit_by[ph])))
    return {ph: {"measured_ms_min": r["measured_ms"][0], "measured_ms_median": statistics.median(r["measured_ms"]),
                 "measured_ms_max": r["measured_ms"][-1], "batches": len(r["measured_ms"]),
                 "constant_predictor_holdout_median_ape": statistics.median(r["apes"]) if r["apes"] else None}
            for ph, r in out.items()}


def error_split(held: dict[str, Any], fitting: dict[str, Any], phase_of: dict[int, str]) -> dict[str, Any]:
    return {"shape_only_request_e2e_median_ape": shape_only(held),
            "makespan_spread": makespan_spread(held, fitting, phase_of)}


def render_split(split: dict[str, Any] | None) -> list[str]:
    if not split:
        return []
    s = split["shape_only_request_e2e_median_ape"]
    lines = ["  what the held-out error is made of:" + (
        "" if s is None else f" request e2e with each batch's own speed {100 * s:.1f}% (schedule shape only)")]
    for ph, r in sorted(split["makespan_spread"].items()):
        c = r["constant_predictor_holdout_median_ape"]
        lines.append(f"    {ph}: measured makespan {r['measured_ms_min']:.0f} .. {r['measured_ms_median']:.0f} .. "
                     f"{r['measured_ms_max']:.0f} ms over {r['batches']} batches of one shape; a constant per-phase "
                     f"predictor's held-out median error {'n/a' if c is None else f'{100 * c:.1f}%'}")
    return lines
