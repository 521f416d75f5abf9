"""Barrier vs partial rollout on a multi-turn task with skewed turn counts (unirl-agentic).

A barrier drive launches exactly the groups it needs and waits for the slowest trajectory; a partial
drive over-generates (``over_generate``), commits the first groups to complete and carries the tail into
the next drive. Both run the real embedded TorchEngine (tiny Qwen3) through AgenticRolloutController
and a stateless environment whose trajectories take 1 turn, except a ``--long-frac`` share that takes
``--long-turns``. The sides alternate (barrier, partial, barrier, ...) in one process, and the script
prints committed trajectories/s of each and the ratio partial / barrier.

    .venv/bin/python benchmarks/agentic_partial.py --drives 6 --reps 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=8, help="groups committed per drive")
    ap.add_argument("--n", type=int, default=4, help="siblings per group")
    ap.add_argument("--drives", type=int, default=6, help="drives per measurement")
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions of each side")
    ap.add_argument("--long-frac", type=float, default=0.15, help="share of trajectories that run long")
    ap.add_argument("--long-turns", type=int, default=6)
    ap.add_argument("--over-generate", type=float, default=1.5)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--interrupt", choices=["drain", "abort"], default="drain", help="how the tail stops")
    args = ap.parse_args()

    import torch
    from unirl_agentic.controller import AgenticRolloutController
    from unirl_agentic.options import AgenticOptions

    from unirl.api import (
        Environment,
        EnvStep,
        Qwen3Adapter,
        RunConfig,
        Sample,
        SamplingParams,
        build_demo_tokenizer,
        build_engine,
    )
    from unirl.samples import stable_seed

    torch.set_num_threads(args.threads)
    tok = build_demo_tokenizer()
    engine = build_engine(RunConfig(), adapter=Qwen3Adapter(), tokenizer=tok)

    class Skewed(Environment):
        """Stateless: a trajectory is long with probability long_frac (keyed on its id, so both sides
        see the same distribution)."""

        def __init__(self):
            self.turns: dict[str, int] = {}

        def reset(self, sample):
            self.turns[sample.id] = 0

        def step(self, sample, turn_text):
            self.turns[sample.id] += 1
            long = (stable_seed("long", sample.id) % 10_000) / 10_000 < args.long_frac
            if self.turns[sample.id] >= (args.long_turns if long else 1):
                return EnvStep(done=True, reward=0.0)
            return EnvStep(observation=" ok.")

        def close(self, sample):
            self.turns.pop(sample.id, None)

    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    counter = {"p": 0}

    def draw(k: int) -> list[Sample]:
        out = []
        for _ in range(k):
            i = counter["p"]
            counter["p"] += 1
            out.append(Sample(id=f"p{i}", prompt_ids=tok.encode(f"Q: {i}*7=? A:"), answer=0))
        return out

    def side(over: float) -> float:
        ctl = AgenticRolloutController(engine, Skewed(), tok, lambda t, s: 0.0,
                                       AgenticOptions(over_generate=over, tail="carry", interrupt=args.interrupt,
                                                      max_inflight_requests=256,
                                                      trajectories_per_worker=256), base_seed=1)
        ctl.collect(draw, groups=args.groups, n=args.n, sampling=sampling)  # warm-up drive, not timed
        t0, done = time.perf_counter(), 0
        for _ in range(args.drives):
            done += len(ctl.collect(draw, groups=args.groups, n=args.n, sampling=sampling))
        dt = time.perf_counter() - t0
        ctl.close()
        return done / dt

    print(f"load before: {os.getloadavg()[0]:.2f} (1-min avg; the machine is shared)")
    results: dict[str, list[float]] = {"barrier": [], "partial": []}
    for _ in range(args.reps):
        results["barrier"].append(side(1.0))
        results["partial"].append(side(args.over_generate))
    b, p = statistics.median(results["barrier"]), statistics.median(results["partial"])
    print(f"barrier  {b:7.2f} trajectories/s  (runs: {', '.join(f'{x:.2f}' for x in results['barrier'])})")
    print(f"partial  {p:7.2f} trajectories/s  (runs: {', '.join(f'{x:.2f}' for x in results['partial'])}), "
          f"over_generate {args.over_generate}, tail carry, interrupt {args.interrupt}")
    print(f"ratio partial / barrier: {p / b:.2f}x   load after: {os.getloadavg()[0]:.2f}")
    engine.close()


if __name__ == "__main__":
    main()
