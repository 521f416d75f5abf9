"""How a trace replay report is shown: the text summary (:func:`render`) and the predicted-against-
measured plot (:func:`plot`), with the plot helpers :mod:`unirl_replay_trace.calibrate` shares.

Why a module of its own: :mod:`unirl_replay_trace.replay` computes the report; this only presents it
(and imports matplotlib only when asked for a plot). Re-exported by :mod:`unirl_replay_trace.replay`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unirl.api import atomic_write_with
from unirl_replay_trace.stream_trace import stream_lines

#: written into the plot's PNG metadata (how a later run knows it may replace the file)
PLOT_MARK = "unirl trace replay plot"


def render(report: dict[str, Any]) -> str:
    lines = [f"trace replay ({report['format']}, {report['mode']}): {report['requests']} requests in "
             f"{report['batches']} batch(es) from {report['trace']}",
             f"  timing model: {report['timing_model']}", f"  NOTE: {report['note']}",
             f"  arrivals: {report.get('arrivals', 'barrier')} (first turns at their "
             f"{'observed submit offsets' if report.get('arrivals') == 'observed' else 'batch barrier'})"]
    skew = (report.get("dynamo") or {}).get("version_skew")
    if skew:
        lines.append(f"  WARNING (--allow-version-skew): {skew}")
    warm = [c for c in report.get("initial_cache", []) if c.get("cold_start_mismatch")]
    if warm:
        lines.append(f"  WARNING: {len(warm)} batch(es) started on a warm engine cache (e.g. batch {warm[0]['batch']}: "
                     f"<= {warm[0].get('prefix_tokens')} prefix tokens); the replay starts cold")
    waits = [w for w in report.get("waits", []) if w["waits"]]
    if waits:
        tool = sum(w["tool_ms_total"] for w in waits)
        over = sum(w["overhead_ms_total"] for w in waits)
        n_split = sum(w["with_tool_time"] for w in waits)
        lines.append(f"  waits between turns: {sum(w['waits'] for w in waits)} ({sum(w['wait_ms_total'] for w in waits):.1f} ms); "
                     f"{n_split} with tool time measured: tool {tool:.1f} ms, controller overhead {over:.1f} ms")
    if report.get("per_request_refused"):
        lines.append(f"  {report['per_request_refused']}")
    if report["mode"] == "aggregate-only":
        lines.append(f"  aggregate-only: {report['why']}")
    for name, s in report["aggregate"].items():
        if not s.get("n"):
            lines.append(f"  {name:<17} n/a" + (f" ({s['note']})" if "note" in s else ""))
            continue
        ratio = s["mean_ratio_predicted_over_measured"]
        lines.append(f"  {name:<17} n={s['n']:<4} measured mean {s['measured_mean_ms']:9.2f} ms  predicted mean "
                     f"{s['predicted_mean_ms']:9.2f} ms  |err| {s['mean_abs_error_ms']:9.2f} ms  "
                     f"pred/meas {'-' if ratio is None else f'{ratio:.3g}'}")
    for o in report["occupancy"]:
        lines.append(f"  batch {o['batch']}: measured peak {o['max_in_flight_requests']} in-flight requests, "
                     f"{o['max_occupied_trajectory_slots']} occupied trajectory slots, "
                     f"{o['max_occupied_group_slots']} occupied group slots")
    cal = report.get("calibration")
    if cal:
        lines.append(f"  calibration on batches {cal['calibration_batches']}: chose {cal['chosen']} "
                     f"(error {cal['calibration_error']:.3f}); held-out batches {cal['holdout_batches']}: error "
                     f"{cal['holdout_error']:.3f} (default params {cal['holdout_error_default_params']:.3f}); "
                     f"{cal['error']}")
    lines += _whatif_lines(report.get("whatif"))
    lines += stream_lines(report.get("stream"))
    return "\n".join(lines)


def _whatif_lines(w: dict[str, Any] | None) -> list[str]:
    """The what-if section: the fleet asked about against the replay of the captured fleet."""
    if not w:
        return []
    ratio = w["median_batch_ratio_whatif_over_captured"]
    return [f"  what-if {w['fleet']} (captured: {w['captured_workers']} worker(s), {w['captured_engine_args']}):",
            f"    predicted rollout time {w['rollout_ms_predicted_whatif']:.1f} ms over {len(w['batches'])} batch(es), "
            f"against {w['rollout_ms_predicted_captured_fleet']:.1f} ms predicted at the captured fleet (measured there: "
            f"{w['rollout_ms_measured_captured_fleet']:.1f} ms); median batch ratio "
            f"{'-' if ratio is None else f'{ratio:.3f}'}",
            f"    NOTE: {w['note']}"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None without matplotlib (plots are optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def scatter_positive(ax: Any, pts: list[tuple[float, float]], **style: Any) -> list[float]:
    """Scatter the (measured, predicted) points that a log-log axis can show (both > 0; a zero or a
    missing prediction would be dropped by matplotlib with a warning); the values drawn, for
    :func:`log_diagonal`."""
    pts = [(m, p) for m, p in pts if m is not None and p is not None and m > 0 and p > 0]
    if not pts:
        return []
    ax.scatter([m for m, _ in pts], [p for _, p in pts], **style)
    return [v for pt in pts for v in pt]


def log_diagonal(ax: Any, values: list[float]) -> None:
    """Log-log axes and the predicted = measured line across ``values`` (a perfect prediction lies on it)."""
    if values:
        lo, hi = min(values) * 0.8, max(values) * 1.25
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="predicted = measured")
        ax.set_xscale("log")
        ax.set_yscale("log")


def save_png(plt: Any, fig: Any, path: Path, mark: str) -> Path:
    """Write ``fig`` to ``path`` atomically (no half-written plot), with ``mark`` in its metadata (so a
    later ``--force``-less run knows the file is its own), and close it. The format is given: the suffix
    of a user-named path decides nothing."""
    try:
        return atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png",
                                                               metadata={"Description": mark}))
    finally:
        plt.close(fig)


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """Predicted against measured (log-log, the diagonal is a perfect prediction); None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 5))
    series: list[tuple[str, list[tuple[float, float]], str]] = []
    joined = [r for r in report["per_request"] if r["measured"]]
    series.append(("request e2e", [(r["measured"]["e2e"], r["predicted"]["e2e"]) for r in joined], "o"))
    series.append(("request TTFT", [(r["measured"]["ttft"], r["predicted"]["ttft"]) for r in joined
                                    if r["measured"]["ttft"] is not None], "."))
    series.append(("group completion", [(g["measured_ms"], g["predicted_ms"]) for g in report["group_completion"]], "s"))
    series.append(("batch readiness", [(b["measured_ms"], b["predicted_ms"]) for b in report["batch_readiness"]], "*"))
    if report["mode"] == "aggregate-only":
        for name, s in report["aggregate"].items():
            if s.get("n") and name != "batch_readiness":
                series.append((f"{name} (aggregate)", [(s["measured_mean_ms"], s["predicted_mean_ms"])], "D"))
    values = []
    for label, pts, marker in series:
        values += scatter_positive(ax, pts, marker=marker, label=label, alpha=0.7)
    log_diagonal(ax, values)
    ax.set_xlabel("measured (ms from batch barrier / per request)")
    ax.set_ylabel("predicted by Dynamo replay (ms)")
    ax.set_title(f"{report['mode']}: {report['timing_model'][:60]}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_png(plt, fig, path, PLOT_MARK)
