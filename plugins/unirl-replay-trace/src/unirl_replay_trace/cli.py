"""``unirl trace replay RUN_DIR``: replay a captured rollout trace in Dynamo, predicted vs measured.

Writes ``report.json`` and ``replay.png`` into the trace directory (or where ``--json`` / ``--png``
say) and prints the summary. Exit status 0 when the replay ran and every request was joined.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from unirl_replay_trace.formats import FORMATS


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
    args = p.parse_args(argv)

    from unirl_replay_trace.replay import parse_fit, plot, render, run, trace_dir

    report = run(args.run_dir, fmt=args.format, fit=parse_fit(args.fit), lanes=args.lanes)
    d = trace_dir(args.run_dir)
    out = args.json or d / "report.json"
    out.write_text(json.dumps(report, indent=2))
    png = plot(report, args.png or d / "replay.png")
    print(render(report))
    print(f"  report: {out}" + (f"\n  plot: {png}" if png else "\n  plot: skipped (matplotlib missing)"))
    return 0
