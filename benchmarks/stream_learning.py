"""Does streaming rollout learn as well as sync? Issue 68's "no worse learning" check.

The demo task (arith-tiny: SFT warm start, then GRPO) on the embedded engine, every arm with the same
recipe, seeds, data and number of *trained* samples (every step trains ``--prompts`` whole groups):

* ``sync``          ``rollout.mode: sync``, on-policy: the reference;
* ``stream-S``      ``rollout.mode: stream``, ``max_staleness: S``, ``weight_sync_interval: 1``, for S in
                    ``--staleness`` (default 1 and 2), uncorrected (``rollout_correction`` ``mode: none``:
                    diagnostics only);
* ``stream-S+C``    the same stream run with the correction ``C`` (``--correction``, default ``token_tis``
                    with cap 2, the documented setting for async: docs/rollout-correction.md).

Unlike async at ``weight_sync_interval: 1``, stream's staleness is not deterministic: which groups are
trained depends on which finish first, i.e. on the machine's speed. The printed ``staleness`` column is
the measured mean version lag of the trained groups (from each group's oldest token), and ``evicted``
the groups generated but dropped as too stale.

Per arm it prints every seed's held-out avg@k at the end (equal samples), the mean, standard deviation
and min..max over seeds, and the verdict of the acceptance: a stream arm is "within the spread" when
``sync mean - arm mean <= sd_sync + sd_arm`` (the same rule as ``correction_async.py``). Beside it, the
paired difference per seed (arm - sync: the same SFT start, data and eval prompts), which is the stricter
view: most of the seeds' spread is the SFT start's.

Every run is a fresh process with one torch thread; ``--jobs`` run at once (2 on 2 cores).

    nice -n 10 python benchmarks/stream_learning.py [--seeds 3] [--staleness 1 2] [--jobs 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the corrections a stream arm may add (threshold = cap / upper edge, threshold_lower = lower edge)
CORRECTIONS = {
    "token_tis": "{mode: token_tis, threshold: 2.0}",
    "seq_mask": "{mode: seq_mask, threshold: 2.0, threshold_lower: 0.5}",
    "geo_mask": "{mode: geo_mask, threshold: 1.25, threshold_lower: 0.8}",
}


def arms(staleness: list[int], correction: str | None) -> list[str]:
    names = ["sync", *(f"stream-{s}" for s in staleness)]
    return names + ([f"stream-{s}+{correction}" for s in staleness] if correction else [])


def overrides(arm: str, seed: int, args: argparse.Namespace, out: str) -> list[str]:
    """The config of one run: the recipe, the benchmark's shared settings, then what the arm changes."""
    common = [
        f"run.output_dir={out}", f"run.name={arm}-s{seed}", f"run.seed={seed}", f"trainer.steps={args.steps}",
        f"trainer.prompts_per_step={args.prompts}", f"trainer.eval_every={args.eval_every}",
        f"trainer.eval_k={args.eval_k}", "trainer.plot=false", "trainer.progress=false", "trainer.save_every=0",
        "trainer.export_hf=false", f"sft.steps={args.sft_steps}", f"actor.lr={args.lr}",
        "algorithm.modifiers=[rollout_correction]",
    ]
    if arm == "sync":
        return [*common, "plugins.rollout_correction={mode: none}"]
    stale, _, fix = arm.removeprefix("stream-").partition("+")
    return [*common, "rollout.mode=stream", f"rollout.max_staleness={stale}", "rollout.weight_sync_interval=1",
            f"plugins.rollout_correction={CORRECTIONS[fix] if fix else '{mode: none}'}"]


def worker(arm: str, seed: int, args: argparse.Namespace, dest: Path) -> None:
    """One run in this process; writes its final held-out accuracy and stream figures to ``dest`` (JSON)."""
    import torch

    torch.set_num_threads(1)
    from unirl.config import load_config
    from unirl.kernel import load_kernel
    from unirl.trainer.loop import train

    with tempfile.TemporaryDirectory() as out:
        config = load_config(ROOT / "recipes" / "arith-tiny.yaml", overrides(arm, seed, args, out))
        t0 = time.perf_counter()
        result = train(config, load_kernel())
        seconds = time.perf_counter() - t0
    steps = [h for h in result.history if h["step"] > 0]
    mean = lambda key: statistics.mean(h.get(key, 0.0) for h in steps)  # noqa: E731
    dest.write_text(json.dumps({
        "arm": arm, "seed": seed, "final": result.eval_after, "before": result.eval_before, "s": seconds,
        "samples": len(steps) * args.prompts * config.rollout.n,
        "staleness": mean("staleness_mean"), "staleness_max": max(h.get("staleness_max", 0.0) for h in steps),
        "evicted": sum(h.get("stream/evicted_groups", 0.0) for h in steps), "kl_k3": mean("rc/kl_k3"),
        "dlogp": mean("rc/logp_diff_abs_mean"),
    }))


def spawn(arm: str, seed: int, args: argparse.Namespace, tmp: Path) -> dict:
    dest = tmp / f"{arm}-{seed}.json"
    cmd = [sys.executable, __file__, "--worker", arm, str(seed), "--dest", str(dest), *_shared(args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"run {arm} seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(dest.read_text())
    load = os.getloadavg()[0]
    print(f"  {arm} seed {seed}: avg@k {out['before']:.3f} -> {out['final']:.3f}, staleness {out['staleness']:.2f}, "
          f"evicted {out['evicted']:.0f} ({out['s']:.0f} s, load {load:.1f})", file=sys.stderr, flush=True)
    return out


def _shared(args: argparse.Namespace) -> list[str]:
    return [f"--steps={args.steps}", f"--prompts={args.prompts}", f"--sft-steps={args.sft_steps}", f"--lr={args.lr}",
            f"--eval-every={args.eval_every}", f"--eval-k={args.eval_k}"]


def summarise(vals: list[float]) -> tuple[float, float, float, float]:
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return statistics.mean(vals), sd, min(vals), max(vals)


def report(results: dict[str, list[dict]], wall: float, args: argparse.Namespace) -> list[str]:
    seeds = sorted({r["seed"] for runs in results.values() for r in runs})
    lines = [f"arith-tiny, {args.steps} RL steps x {args.prompts} prompts x 8 samples (equal trained samples), "
             f"SFT {args.sft_steps}, lr {args.lr}, held-out avg@{args.eval_k}, seeds {seeds}",
             f"{'arm':<22}" + "".join(f"{f'seed {s}':>8}" for s in seeds)
             + f"{'mean':>8}{'sd':>7}{'min..max':>14}{'stale':>7}{'evicted':>8}{'|dlogp|':>9}{'s/run':>7}"]
    stats = {}
    for arm, runs in results.items():
        vals = [r["final"] for r in runs]
        mean, sd, lo, hi = summarise(vals)
        stats[arm] = (mean, sd)
        lines.append(f"{arm:<22}" + "".join(f"{v:>8.3f}" for v in vals) + f"{mean:>8.3f}{sd:>7.3f}"
                     f"{f'{lo:.3f}..{hi:.3f}':>14}{statistics.mean(r['staleness'] for r in runs):>7.2f}"
                     f"{statistics.mean(r['evicted'] for r in runs):>8.1f}{statistics.mean(r['dlogp'] for r in runs):>9.4f}"
                     f"{statistics.mean(r['s'] for r in runs):>7.0f}")
    before = statistics.mean(r["before"] for r in results["sync"])
    lines.append(f"held-out avg@k before RL (after SFT): {before:.3f}; wall {wall / 60:.1f} min, "
                 f"load average at the end {os.getloadavg()[0]:.1f}")
    sync_m, sync_sd = stats["sync"]
    verdicts = []
    for arm, (m, sd) in stats.items():
        if arm == "sync":
            continue
        ok = sync_m - m <= sync_sd + sd
        verdicts.append(ok)
        # paired by seed (same SFT start, data and eval prompts): the seeds' spread is mostly the SFT start's
        diffs = [r["final"] - q["final"] for r, q in zip(results[arm], results["sync"], strict=True)]
        d_m, d_sd, _, _ = summarise(diffs)
        lines.append(f"{arm}: sync - arm = {sync_m - m:+.3f} (spread sd_sync + sd_arm = {sync_sd + sd:.3f}): "
                     f"{'within the spread' if ok else 'WORSE beyond the spread'}; paired arm - sync per seed "
                     f"{', '.join(f'{d:+.3f}' for d in diffs)} (mean {d_m:+.3f}, sd {d_sd:.3f})")
    lines.append(f"no worse learning: {'met' if all(verdicts) else 'not met'} ({sum(verdicts)}/{len(verdicts)} arms)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=32, help="RL steps per run")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per step (x rollout.n = 8)")
    ap.add_argument("--sft-steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=7e-4)
    ap.add_argument("--eval-every", type=int, default=8)
    ap.add_argument("--eval-k", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=3, help="seeds per arm (0 .. N-1)")
    ap.add_argument("--staleness", type=int, nargs="+", default=[1, 2], help="the stream arms' max_staleness")
    ap.add_argument("--correction", default="token_tis", choices=[*CORRECTIONS, "none"],
                    help="the correction of the corrected stream arms ('none': no corrected arms)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (one torch thread each)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 seed, staleness 1, tiny budget")
    ap.add_argument("--worker", nargs=2, metavar=("ARM", "SEED"), help=argparse.SUPPRESS)
    ap.add_argument("--dest", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args, Path(args.dest))
        return
    if args.quick:
        args.steps, args.prompts, args.sft_steps, args.eval_every, args.eval_k = 4, 8, 20, 2, 2
        args.seeds, args.staleness = 1, [1]
    if args.seeds < 1 or args.steps < 1 or args.eval_every < 1 or any(s < 0 for s in args.staleness):
        ap.error("--seeds, --steps and --eval-every must be >= 1, every --staleness >= 0")
    names = arms(args.staleness, None if args.correction == "none" else args.correction)
    jobs = [(arm, seed) for seed in range(args.seeds) for arm in names]  # interleaved: every seed's arms together
    print(f"uptime before: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}", flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max(1, args.jobs)) as pool:
        done = list(pool.map(lambda j: spawn(j[0], j[1], args, Path(tmp)), jobs))
    wall = time.perf_counter() - t0
    results = {arm: sorted((r for r in done if r["arm"] == arm), key=lambda r: r["seed"]) for arm in names}
    for line in report(results, wall, args):
        print(line, flush=True)


if __name__ == "__main__":
    main()
