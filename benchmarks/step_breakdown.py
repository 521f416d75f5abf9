"""Seconds per GRPO step, split into rollout / replay (pi_old + advantages) / train (forward, backward,
optimizer) / weight sync, on the demo recipe with the embedded engine and actor.

The ratio printed is each phase's share of the step, so the number to watch does not depend on the
machine: on this tiny model rollout and train should dominate, and sync should be a few percent. It
also says how much of the pi_old replay the recipe needs (:mod:`unirl.trainer.replay`; the
demo's ``updates_per_batch: 4`` replays its last 3 mini-batches only).
``benchmarks/grpo_step_vs_floor.py`` is the issue-10 workload against a plain-PyTorch floor.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from unirl.config import load_config
from unirl.kernel import load_kernel
from unirl.trainer.loop import train
from unirl.trainer.replay import replay_reasons, replay_scope

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout_s", "replay_s", "train_s", "sync_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "arith-tiny.yaml"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        config = load_config(args.recipe, [f"run.output_dir={out}", f"trainer.steps={args.steps}", "sft.steps=0",
                                           "trainer.eval_every=0", "trainer.plot=false", "trainer.progress=false",
                                           *args.overrides])
        result = train(config, load_kernel())
    steps = [h for h in result.history if h["step"] > 1]  # step 1 warms caches
    total = statistics.mean(sum(h[p] for p in PHASES) for h in steps)
    print(f"{'phase':<12}{'s/step':>10}{'share':>10}")
    for p in PHASES:
        mean = statistics.mean(h[p] for h in steps)
        print(f"{p[:-2]:<12}{mean:>10.3f}{mean / total:>10.1%}")
    print(f"{'total':<12}{total:>10.3f}{1:>10.1%}")
    tokens = statistics.mean(h["rollout_tokens"] for h in steps)
    print(f"rollout tokens/step {tokens:.0f}; engine {config.rollout.engine}, actor {config.actor.name}, "
          f"micro-batch {config.actor.micro_batch_size}")
    reasons, scope = replay_reasons(config), replay_scope(config)
    if scope == "later":
        print("pi_old replay: the mini-batches after the first only (" + "; ".join(reasons) + "); the first "
              "update's forward is its own pi_old")
    else:
        print("pi_old replay: " + ("needed (" + "; ".join(reasons) + ")" if reasons else
                                   "redundant under this recipe (the training forward's log-probs are pi_old)"))


if __name__ == "__main__":
    main()
