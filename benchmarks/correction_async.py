"""Does rollout correction recover the on-policy curve under async staleness? Sync vs stale async,
uncorrected and with ``token_tis`` / ``seq_mask`` / ``geo_mask``, several seeds per arm.

The demo task (arith-tiny: SFT warm start, then GRPO) on the embedded engine, every arm with the same
recipe, seeds, data and number of samples:

* ``sync``          on-policy (``rollout.mode: sync``): the reference curve;
* ``async-L``       ``rollout.mode: async`` with ``weight_sync_interval: L`` and ``max_staleness: 0``,
                    uncorrected (``mode: none``, diagnostics only), for every lag L in ``--lags``;
* ``L+token_tis``, ``L+seq_mask``, ``L+geo_mask``  the same async run at the largest lag, corrected.

Why the lag is ``weight_sync_interval`` and not ``max_staleness``: async keeps at most one collect ahead
of the trainer, so at ``weight_sync_interval: 1`` a ``max_staleness`` above 1 adds no lag
(docs/async.md). The engine's weights move only at a sync; with a sync every L steps (and
``max_staleness: 0`` keeping every collect inside its window) batch j of a window was sampled by a
policy j trainer steps (j * ``updates_per_batch`` optimizer steps) behind pi_old. That lag of
0 .. L-1 steps is deterministic: an arm's data does not depend on how fast the machine is.

Per arm it prints the held-out avg@k of the trainer's weights at equal samples (mean, standard
deviation and min..max over seeds), the mean global and micro-local ESS of the applied weights, the
share of truncated / masked tokens, the engine-vs-pi_old mismatch (mean |dlogp|, k3 KL), and writes
a PNG of the eval curves. "Beyond the spread" means the sync-minus-uncorrected gap exceeds the sum of
the two arms' standard deviations. The last line is the share of the sync-vs-uncorrected gap (at the
largest lag) that the best correction closes: ``gap closed: X.XX`` (``n/a`` when there is no gap).

Every run is a fresh process with one torch thread; ``--jobs`` run at once (2 on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the corrections compared at the largest lag (threshold = cap / upper edge, threshold_lower = lower edge;
#: ``{tis}`` is ``--tis-threshold``)
CORRECTIONS = {
    "token_tis": "{{mode: token_tis, threshold: {tis}}}",
    "seq_mask": "{{mode: seq_mask, threshold: 2.0, threshold_lower: 0.5}}",
    "geo_mask": "{{mode: geo_mask, threshold: 1.25, threshold_lower: 0.8}}",
}
#: the per-step diagnostics averaged over the run
DIAG = ("rc/ess_frac_global", "rc/ess_frac_micro", "rc/clipped_token_frac", "rc/logp_diff_abs_mean", "rc/kl_k3")


def arms(lags: list[int], corrections: list[str]) -> list[str]:
    top = max(lags)
    return ["sync", *(f"async-{lag}" for lag in sorted(lags)), *(f"{top}+{c}" for c in corrections)]


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
    lag, _, fix = arm.removeprefix("async-").partition("+")
    section = CORRECTIONS[fix].format(tis=args.tis_threshold) if fix else "{mode: none}"
    return [*common, "rollout.mode=async", "rollout.max_staleness=0", f"rollout.weight_sync_interval={lag}",
            f"plugins.rollout_correction={section}"]


def worker(arm: str, seed: int, args: argparse.Namespace, dest: Path) -> None:
    """One run in this process; writes its eval curve and mean diagnostics to ``dest`` (JSON)."""
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
    samples_per_step = args.prompts * config.rollout.n
    curve = [(h["step"] * samples_per_step, h["eval"]) for h in result.history if "eval" in h]
    diag = {k: statistics.mean(h[k] for h in steps) for k in DIAG}
    diag["staleness_mean"] = statistics.mean(h.get("staleness_mean", 0.0) for h in steps)
    dest.write_text(json.dumps({"arm": arm, "seed": seed, "final": result.eval_after, "before": result.eval_before,
                                "curve": curve, "diag": diag, "s": seconds}))


def spawn(arm: str, seed: int, args: argparse.Namespace, tmp: Path) -> dict:
    dest = tmp / f"{arm}-{seed}.json"
    cmd = [sys.executable, __file__, "--worker", arm, str(seed), "--dest", str(dest), *_shared(args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"run {arm} seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(dest.read_text())
    print(f"  {arm} seed {seed}: avg@k {out['before']:.3f} -> {out['final']:.3f} ({out['s']:.0f} s)", file=sys.stderr,
          flush=True)
    return out


def _shared(args: argparse.Namespace) -> list[str]:
    return [f"--steps={args.steps}", f"--prompts={args.prompts}", f"--sft-steps={args.sft_steps}", f"--lr={args.lr}",
            f"--eval-every={args.eval_every}", f"--eval-k={args.eval_k}", f"--tis-threshold={args.tis_threshold}"]


def summarise(vals: list[float]) -> tuple[float, float, float, float]:
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return statistics.mean(vals), sd, min(vals), max(vals)


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, runs in results.items():
        xs = [x for x, _ in runs[0]["curve"]]
        ys = [statistics.mean(r["curve"][i][1] for r in runs) for i in range(len(xs))]
        ax.plot(xs, ys, marker="o", ms=3, label=arm, lw=2.2 if arm == "sync" else 1.4,
                ls="--" if arm.startswith("async-") else "-")
    ax.set_xlabel("training samples")
    ax.set_ylabel(f"held-out avg@k (mean of {len(next(iter(results.values())))} seeds)")
    ax.set_title("rollout correction under async staleness (arith-tiny)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(results: dict[str, list[dict]], lags: list[int], corrections: list[str], wall: float,
           args: argparse.Namespace) -> list[str]:
    lines = [f"arith-tiny, {args.steps} RL steps x {args.prompts} prompts x 8 samples, SFT {args.sft_steps}, "
             f"lr {args.lr}, seeds {args.seeds}; async lag L = weight_sync_interval (max_staleness 0); token_tis cap "
             f"{args.tis_threshold}",
             f"{'arm':<16}{'avg@k mean':>11}{'sd':>7}{'min..max':>14}{'ESS glob':>9}{'ESS micro':>10}"
             f"{'trunc/mask':>11}{'|dlogp|':>9}{'k3 KL':>8}{'s/run':>7}"]
    stats = {}
    for arm, runs in results.items():
        mean, sd, lo, hi = summarise([r["final"] for r in runs])
        stats[arm] = (mean, sd)
        d = {k: statistics.mean(r["diag"][k] for r in runs) for k in runs[0]["diag"]}
        lines.append(f"{arm:<16}{mean:>11.3f}{sd:>7.3f}{f'{lo:.3f}..{hi:.3f}':>14}{d['rc/ess_frac_global']:>9.3f}"
                     f"{d['rc/ess_frac_micro']:>10.3f}{d['rc/clipped_token_frac']:>11.3f}"
                     f"{d['rc/logp_diff_abs_mean']:>9.3f}{d['rc/kl_k3']:>8.4f}"
                     f"{statistics.mean(r['s'] for r in runs):>7.0f}")
    before = statistics.mean(r["before"] for r in results["sync"])
    lines.append(f"held-out avg@k before RL (after SFT): {before:.3f}; wall {wall / 60:.1f} min")
    sync_m, sync_sd = stats["sync"]
    for lag in sorted(lags):
        m, sd = stats[f"async-{lag}"]
        gap = sync_m - m
        lines.append(f"lag {lag}: sync - uncorrected = {gap:+.3f} (spread sd_sync + sd_unc = {sync_sd + sd:.3f}): "
                     f"{'worse beyond the spread' if gap > sync_sd + sd else 'not beyond the spread'}")
    top = max(lags)
    unc = stats[f"async-{top}"][0]
    gap = sync_m - unc
    best = max(corrections, key=lambda c: stats[f"{top}+{c}"][0]) if corrections else None
    if best is None or gap <= 0:
        lines.append(f"gap closed: n/a (sync - uncorrected at lag {top} = {gap:+.3f}: no gap to close)")
    else:
        lines.append(f"best correction at lag {top}: {best} ({stats[f'{top}+{best}'][0]:.3f})")
        lines.append(f"gap closed: {(stats[f'{top}+{best}'][0] - unc) / gap:.2f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=32, help="RL steps per run")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per step (x rollout.n = 8)")
    ap.add_argument("--sft-steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=7e-4)
    ap.add_argument("--eval-every", type=int, default=8,
                    help="a multiple of every lag: async arms are then evaluated right after a sync")
    ap.add_argument("--eval-k", type=int, default=16)
    ap.add_argument("--tis-threshold", type=float, default=2.0, help="token_tis: the cap C of min(pi_old / mu, C)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per arm (0 .. N-1)")
    ap.add_argument("--lags", type=int, nargs="+", default=[2, 4, 8], help="async lags (weight_sync_interval)")
    ap.add_argument("--corrections", nargs="*", default=list(CORRECTIONS), choices=list(CORRECTIONS))
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (one torch thread each)")
    ap.add_argument("--png", default=str(ROOT / "runs" / "correction_async.png"), help="where the curves go")
    ap.add_argument("--quick", action="store_true", help="a CI smoke run: 2 seeds, 1 lag, tiny budget")
    ap.add_argument("--worker", nargs=2, metavar=("ARM", "SEED"), help=argparse.SUPPRESS)
    ap.add_argument("--dest", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args, Path(args.dest))
        return
    if args.quick:
        # a hotter lr than the defaults: 4 steps must still move the policy enough for a real mismatch
        args.steps, args.prompts, args.sft_steps, args.eval_every, args.eval_k, args.lr = 4, 8, 20, 2, 2, 2e-3
        args.seeds, args.lags, args.corrections = 2, [2], ["token_tis"]
    if args.seeds < 1 or any(lag < 1 for lag in args.lags) or args.steps < 1 or args.eval_every < 1:
        ap.error("--seeds, --steps, --eval-every and every --lags value must be >= 1")
    if any(args.eval_every % lag for lag in args.lags) or args.steps % args.eval_every:
        # mid-window, an async engine still serves the last sync's weights (docs/async.md): the eval would
        # score a stale policy, and the curves would compare arms at different points of their windows
        ap.error(f"--eval-every {args.eval_every} must be a multiple of every --lags value ({args.lags}) and divide "
                 f"--steps {args.steps}: e.g. --eval-every {math.lcm(*args.lags)}")
    names = arms(args.lags, args.corrections)
    jobs = [(arm, seed) for seed in range(args.seeds) for arm in names]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max(1, args.jobs)) as pool:
        done = list(pool.map(lambda j: spawn(j[0], j[1], args, Path(tmp)), jobs))
    wall = time.perf_counter() - t0
    results = {arm: sorted((r for r in done if r["arm"] == arm), key=lambda r: r["seed"]) for arm in names}
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    plot(results, Path(args.png))
    print(f"curves: {args.png}")
    for line in report(results, args.lags, args.corrections, wall, args):
        print(line, flush=True)


if __name__ == "__main__":
    main()
