"""Regression oracle: each CPU recipe's ``metrics.jsonl`` at two git revisions, compared bit for bit.

Why: a refactor that claims "behaviour unchanged" (issue 72's state ownership, the RolloutDriver split)
must show it on whole runs, not only on unit tests. Seeded runs are deterministic (every seed derives
from ``run.seed`` and the step), so every metric except the wall-clock ones must be identical, float
for float. Each revision is checked out in a ``git worktree`` of its own (the working tree's
uncommitted edits, or another session's, never enter either side) and run with this checkout's
``.venv`` and ``PYTHONPATH`` pointing at that worktree's ``core/src`` and ``plugins/*/src``. Runs are
sequential and interleaved (base, head per recipe): one process at a time.

    .venv/bin/python scripts/metrics_oracle.py --base ddca15b --head HEAD
    .venv/bin/python scripts/metrics_oracle.py --base ddca15b --recipes arith-tiny parity-tiny-embedded

Prints one line per recipe (identical, or the first differing row and keys) and, for the parity
recipes, the tokens compared and the mismatches (``parity_<phase>_*``) on each side. Exit 1 when any differs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv" / "bin" / "python"

#: metrics that measure wall-clock time, rates or memory (they differ between any two runs), excluded
#: by name: the phase timers ``<phase>_s`` (rollout_s, replay_s, train_s, sync_s, load_s, resume_s,
#: first_sync_s, checkpoint_s, eval_s, publish_lag_s ...), ``*seconds`` (eval_agentic/seconds), the idle
#: fractions, the memory peaks (mem/*_peak_mb) and the stream buffer's gauges (stream/*)
TIMING_KEYS = re.compile(
    r"(_s$|_ms$|seconds|^time|wall|_per_s$|tok_s|throughput|idle_frac|peak|_mem|mem_|rss|_bytes$|_mb$|_gb$|"
    r"^inflight_launches$|^stream/)")

#: (name, recipe, overrides): the embedded recipes that run in well under a minute with these steps;
#: each mode's driver (sync, async, stream) and DAPO's refill rounds, the agentic controller, parity
SMALL = ["sft.steps=2", "trainer.steps=4", "trainer.eval_every=2", "trainer.save_every=2", "trainer.plot=false",
         "trainer.export_hf=false", "trainer.progress=false"]
CASES: dict[str, tuple[str, list[str], dict[str, str]]] = {
    "arith-tiny": ("arith-tiny", SMALL, {}),
    "arith-tiny-async": ("arith-tiny", [*SMALL, "rollout.mode=async", "rollout.max_staleness=1"], {}),
    "arith-tiny-dapo": ("arith-tiny", [*SMALL, "algorithm.dynamic_sampling.enabled=true"], {}),
    "arith-tiny-stream": ("arith-tiny", [*SMALL, "rollout.mode=stream", "rollout.max_staleness=1"], {}),
    "arith-moe-tiny": ("arith-moe-tiny", SMALL, {}),
    "agentic-calc-tiny": ("agentic-calc-tiny", [*SMALL, "trainer.prompts_per_step=4"], {}),
    "parity-tiny-embedded": ("parity-tiny-embedded", ["trainer.progress=false", "trainer.export_hf=false",
                                                      "trainer.plot=false"], {"UNIRL_PARITY_ENABLE": "1"}),
    "parity-moe-tiny-embedded": ("parity-moe-tiny-embedded", ["trainer.progress=false", "trainer.export_hf=false",
                                                              "trainer.plot=false"], {"UNIRL_PARITY_ENABLE": "1"}),
}


def worktree(rev: str, where: Path) -> Path:
    """``rev`` checked out (detached) at ``where``, reused when it is already there at that commit."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    if where.exists():
        have = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        if have.strip() == sha:
            return where
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], check=True)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), sha], check=True,
                   capture_output=True)
    return where


def run(tree: Path, case: str, out: Path) -> tuple[list[dict], float, str]:
    """One training run of ``case`` from ``tree``: its metrics rows, the seconds it took, its log tail."""
    recipe, overrides, extra_env = CASES[case]
    paths = [tree / "core" / "src", *sorted((tree / "plugins").glob("*/src"))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths)), **extra_env}
    cmd = [str(PYTHON), "-m", "unirl.cli", "train", str(tree / "recipes" / f"{recipe}.yaml"),
           f"run.output_dir={out}", f"run.name={case}", *overrides]
    shutil.rmtree(out / case, ignore_errors=True)  # a run directory left from before would be resumed
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    log = (proc.stdout + proc.stderr)[-2000:]
    metrics = out / case / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        return [], took, f"exit {proc.returncode}: {log}"
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()], took, log


def seeded(row: dict) -> dict:
    """The row without its timing keys, floats as their exact repr (NaN equal to NaN)."""
    return {k: (repr(v) if isinstance(v, float) else v) for k, v in row.items() if not TIMING_KEYS.search(k)}


def compare(base: list[dict], head: list[dict]) -> str | None:
    """None when every row is identical outside the timing keys; else where they first differ."""
    if len(base) != len(head):
        return f"{len(base)} rows vs {len(head)}"
    for i, (a, b) in enumerate(zip(base, head, strict=True)):
        a, b = seeded(a), seeded(b)
        if a != b:
            keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            shown = ", ".join(f"{k}: {a.get(k)} vs {b.get(k)}" for k in keys[:6])
            return f"row {i} (step {a.get('step')}): {len(keys)} key(s) differ: {shown}"
    return None


def parity_counts(rows: list[dict]) -> str:
    """The parity phases' totals as the last row states them (each ``parity_<phase>_*`` is cumulative):
    tokens compared and mismatches."""
    last = rows[-1] if rows else {}

    def total(suffix: str) -> float:
        return sum(v for k, v in last.items() if k.startswith("parity_") and k.endswith(suffix)
                   and isinstance(v, int | float) and not math.isnan(v))
    return f"{total('_mismatches'):g} mismatches of {total('_tokens'):g} tokens"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the revision before the change (e.g. ddca15b)")
    ap.add_argument("--head", default="HEAD", help="the revision after it (default HEAD)")
    ap.add_argument("--recipes", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--out", default="/tmp/metrics-oracle", help="worktrees and run directories")
    args = ap.parse_args(argv)
    out = Path(args.out)
    trees = {"base": worktree(args.base, out / "base-tree"), "head": worktree(args.head, out / "head-tree")}
    failed = 0
    for case in args.recipes:
        rows, took = {}, {}
        for side in ("base", "head"):
            run_dir = out / "runs" / side
            rows[side], took[side], log = run(trees[side], case, run_dir)
            if not rows[side]:
                print(f"{case}: {side} run failed: {log}", flush=True)
        if not (rows["base"] and rows["head"]):
            failed += 1
            continue
        diff = compare(rows["base"], rows["head"])
        failed += diff is not None
        parity = (f"; parity: base {parity_counts(rows['base'])}, head {parity_counts(rows['head'])}"
                  if CASES[case][2] else "")
        print(f"{case}: {'IDENTICAL' if diff is None else 'DIFFERS ' + diff} ({len(rows['head'])} rows; "
              f"base {took['base']:.0f} s, head {took['head']:.0f} s; load {os.getloadavg()[0]:.1f}){parity}",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
