"""Rollout correction against a deliberately perturbed engine: off vs token_tis vs seq_mask.

The demo task (arith-tiny: SFT warm start, then GRPO) with the embedded engine serving *perturbed*
weights: every synced tensor is multiplied by ``1 + sigma * N(0, 1)`` (fixed noise per tensor, so
the mismatch is systematic, like a lower-precision engine). The trainer replays pi_old with its true
weights, so rollout and replay log-probs really differ. Three runs, same seed, same data:

* ``off``       ``mode: none`` (the uncorrected objective; diagnostics only)
* ``token_tis`` ``w_t = min(pi_old / mu, 2)`` per token
* ``seq_mask``  sequences whose ratio prod_t pi_old / mu leaves [0.5, 2] get weight 0

Held-out accuracy (avg@k on the eval split) is measured with the **trainer's** weights, i.e. the
policy being learned: before each evaluation the clean weights are loaded into the engine and the
perturbed ones put back afterwards. The engine-side accuracy (what the perturbed engine scores) is
printed too. ESS is the mean over steps of ``rc/ess_frac_global`` (the applied weights; 1.0 for off).
The last line is the ratio of each corrected run's final accuracy to off's. A few minutes on 2 cores
with the defaults; no efficacy claim beyond the printed numbers (one seed, a small task).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins" / "unirl-rollout-correction" / "tests"))

from rc_support import perturb_engine  # noqa: E402

import unirl.trainer.evaluator as evaluator  # noqa: E402
import unirl.trainer.loop as loop  # noqa: E402
from unirl.config import load_config  # noqa: E402
from unirl.kernel import load_kernel  # noqa: E402
from unirl.sync.inprocess import InProcessSync  # noqa: E402

RUNS = {
    "off": "{mode: none}",
    "token_tis": "{mode: token_tis, threshold: 2.0}",
    "seq_mask": "{mode: seq_mask, threshold: 2.0, threshold_lower: 0.5}",
}

_real_evaluate = evaluator.evaluate
ENGINE_EVALS: list[float] = []


def clean_evaluate(c, prompts, config, stops, kernel, step, **kw):
    """Evaluate the trainer's weights (clean sync in, eval, perturbed sync back); also the engine's."""
    ENGINE_EVALS.append(evaluator.eval_score(_real_evaluate(c, prompts, config, stops, kernel, step, **kw), config, step))
    version = c.engine.weight_version
    InProcessSync.publish(c.sync, c.actor, c.engine, version)  # the true weights, same version
    try:
        return _real_evaluate(c, prompts, config, stops, kernel, step, **kw)
    finally:
        c.sync.publish(c.actor, c.engine, version)  # perturbed again for the next rollouts


def run(name: str, args: argparse.Namespace, out: str) -> dict:
    config = load_config(ROOT / "recipes" / "arith-tiny.yaml", [
        f"run.output_dir={out}", f"run.name=rc-{name}", f"run.seed={args.seed}", f"trainer.steps={args.steps}",
        f"trainer.prompts_per_step={args.prompts}", f"trainer.eval_every={args.steps}", "trainer.plot=false",
        "trainer.progress=false", "trainer.save_every=0", f"sft.steps={args.sft_steps}",
        "algorithm.modifiers=[rollout_correction]", f"plugins.rollout_correction={RUNS[name]}", *args.overrides])
    kernel = load_kernel()
    perturb_engine(kernel, config.weight_sync.name, sigma=args.sigma, seed=args.seed)
    ENGINE_EVALS.clear()
    t0 = time.perf_counter()
    result = loop.train(config, kernel)
    steps = [h for h in result.history if h["step"] > 0]
    return {
        "before": result.eval_before, "after": result.eval_after, "engine_after": ENGINE_EVALS[-1],
        "ess": statistics.mean(h["rc/ess_frac_global"] for h in steps),
        "clipped": statistics.mean(h["rc/clipped_token_frac"] for h in steps),
        "dlogp": statistics.mean(h["rc/logp_diff_abs_mean"] for h in steps),
        "kl": statistics.mean(h["rc/kl_k3"] for h in steps),
        "reward": statistics.mean(h["reward"] for h in steps[-5:]), "s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="RL steps per run")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (x rollout.n = 8)")
    ap.add_argument("--sft-steps", type=int, default=100)
    ap.add_argument("--sigma", type=float, default=0.2, help="relative weight noise of the engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = ap.parse_args()
    evaluator.evaluate = clean_evaluate
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for name in args.runs:
            results[name] = run(name, args, out)
    print(f"perturbed engine sigma={args.sigma}, seed {args.seed}, {args.steps} RL steps x {args.prompts} prompts "
          f"x 8, SFT {args.sft_steps}")
    print(f"{'run':<11}{'eval before':>12}{'eval after':>11}{'engine eval':>12}{'reward(last5)':>14}"
          f"{'ESS':>7}{'clipped':>9}{'|dlogp|':>9}{'k3 KL':>8}{'s':>6}")
    for name, r in results.items():
        print(f"{name:<11}{r['before']:>12.3f}{r['after']:>11.3f}{r['engine_after']:>12.3f}{r['reward']:>14.3f}"
              f"{r['ess']:>7.3f}{r['clipped']:>9.3f}{r['dlogp']:>9.3f}{r['kl']:>8.4f}{r['s']:>6.0f}")
    if "off" in results:
        base = results["off"]["after"]
        ratios = ", ".join(f"{n}/off {r['after'] / base:.2f}x" if base > 0 else f"{n}/off n/a (off scored 0)"
                           for n, r in results.items() if n != "off")
        print(f"final held-out accuracy ratio: {ratios}")


if __name__ == "__main__":
    main()
