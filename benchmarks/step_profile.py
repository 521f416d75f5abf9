"""Where a GRPO step's time goes: ``torch.profiler`` tables per phase for one ``vs_trl.py`` cell (issue 38).

Why: the issue asks to make the step faster "from profiles, not guesses". The trainer marks each phase
as a ``torch.profiler`` range (``unirl.rollout`` / ``unirl.replay`` / ``unirl.train`` / ``unirl.sync``);
this script runs the cell's recipe (``vs_trl.py``'s ``overrides``: same model, data, batch and sampling, and
the same ``actor.micro_batch_tokens`` budget, ``vs_trl.MICRO_BATCH_TOKENS``, and checkpointing,
``--checkpointing``, by default UniRL's ``selective``) under the
profiler for ``--steps`` steps and, for the last step (the first warms caches), prints per phase:
its wall time, then the ops that took the most self CPU time inside the range (all threads), with their
share of the phase and call count. Beside it, the train phase's achieved FLOP/s (6 N T) as a fraction
of a plain ``torch.mm`` in the cell's precision (``--dtype``, as ``vs_trl.py``'s) measured in the same process.

Run: ``python benchmarks/step_profile.py --size 25m --length 256 [--engine torch] [--rows 12]``.
The profiler adds overhead per op (the decode loop at long responses most): read shares, not seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step_vs_floor import matmul_params, mm_flops  # noqa: E402
from vs_trl import CHECKPOINTING, PROMPTS, UNIRL_CHECKPOINTING, N, Plugin, adapter_for, overrides  # noqa: E402

from unirl.kernel import load_kernel  # noqa: E402

PHASES = ("unirl.rollout", "unirl.replay", "unirl.train", "unirl.sync")


def phase_tables(events, rows: int) -> list[str]:
    """For the last range of each phase: ``(op, self CPU ms, share of the phase's wall, calls)``, top ``rows``."""
    out = []
    for phase in PHASES:
        ranges = [e for e in events if e.name == phase]
        if not ranges:
            continue
        t = ranges[-1].time_range
        wall_us = t.end - t.start
        self_us: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        for e in events:
            if e.name in PHASES or not (t.start <= e.time_range.start and e.time_range.end <= t.end):
                continue
            self_us[e.name] += e.self_cpu_time_total
            calls[e.name] += 1
        total = sum(self_us.values())
        out.append(f"{phase}: {wall_us / 1e3:.1f} ms wall, {total / 1e3:.1f} ms self CPU in ops (all threads)")
        out.append(f"  {'op':<64} {'self ms':>9} {'of phase':>9} {'calls':>7}")
        for name, us in sorted(self_us.items(), key=lambda kv: -kv[1])[:rows]:
            out.append(f"  {name[:64]:<64} {us / 1e3:9.1f} {us / wall_us:9.1%} {calls[name]:7d}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="3m", choices=["3m", "25m", "100m"])
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--engine", default="torch", choices=["torch", "vllm"])
    ap.add_argument("--steps", type=int, default=2, help="the last one is profiled (use >= 2: the first warms caches)")
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--checkpointing", choices=list(UNIRL_CHECKPOINTING), default=CHECKPOINTING, help="as vs_trl.py's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="as vs_trl.py's (bf16: compute on "
                    "fp32 master weights, and the embedded engine's weights)")
    args = ap.parse_args()
    if args.dtype == "bf16":  # as vs_trl.py's children: oneDNN's primitive cache bounded (read at its first use)
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    torch.set_num_threads(args.threads)
    from unirl.config import load_config
    from unirl.data.datasets import load_prompts
    from unirl.models.tokenizer import build_demo_tokenizer
    from unirl.trainer.loop import train

    mm = mm_flops(dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    with tempfile.TemporaryDirectory() as out:
        config = load_config(None, overrides(out, args.steps, args.length, args.engine, args.checkpointing,
                                             args.size, args.dtype))
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            result = train(config, load_kernel(extra=[("vs_trl", Plugin(args.size))]))
        wall = time.perf_counter() - t0
        prompts, _ = load_prompts(config, build_demo_tokenizer(), "train")
    last = result.history[-1]
    params = matmul_params(adapter_for(args.size)().build_model(config))
    tokens = PROMPTS * N * (args.length + statistics.mean(len(p.prompt_ids) for p in prompts[:PROMPTS]))
    print(f"cell {args.size} x {args.length} ({args.engine}, {args.dtype}): {params / 1e6:.1f} M matmul params, {tokens:.0f} "
          f"tokens/step, {args.threads} threads; {args.steps} steps under the profiler in {wall:.0f} s; last step "
          "(profiled): " + ", ".join(f"{p[:-2]} {last[p]:.3f} s" for p in ("rollout_s", "replay_s", "train_s", "sync_s")))
    print(f"train phase: {6 * params * tokens / last['train_s'] / 1e9:.1f} GFLOP/s = "
          f"{6 * params * tokens / last['train_s'] / mm:.0%} of a plain {args.dtype} mm ({mm / 1e9:.1f} GFLOP/s, same process; "
          "profiler overhead included)")
    for line in phase_tables(prof.events(), args.rows):
        print(line)


if __name__ == "__main__":
    main()
