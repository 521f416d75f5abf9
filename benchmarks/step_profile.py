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
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

# every thread's ops: the trainer runs each collect on a watched thread of its own (rollout.stall_timeout_s,
# unirl.rollout.stall), started after the profiler, whose ops a default profiler leaves out
ALL_THREADS = _ExperimentalConfig(profile_all_threads=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step_vs_floor import matmul_params, mm_flops  # noqa: E402
from vs_trl import CHECKPOINTING, PROMPTS, UNIRL_CHECKPOINTING, N, Plugin, adapter_for, overrides  # noqa: E402

from unirl.kernel import load_kernel  # noqa: E402

PHASES = ("unirl.rollout", "unirl.replay", "unirl.train", "unirl.sync")


def op_times(kineto_events) -> list[tuple[str, int, int, int]]:
    """``(name, start_ns, end_ns, self_ns)`` of every CPU event of a profile, from the profiler's raw events
    (``prof.profiler.kineto_results.events()``).

    Why not ``prof.events()``: it builds a Python ``FunctionEvent``, with its list of children, for every
    op. At the 100 M x 1024 cell (a 1,024-token decode of 14 layers, then 65 micro-batches) that took all
    of the machine's 23 GB after the step had run, and the kernel killed the process before a table
    printed. Self time is what ``FunctionEvent.self_cpu_time_total`` is: the event's duration less its
    direct children's, nesting taken per thread from the intervals (``test_benchmark_step_profile.py``
    checks the two agree)."""
    from torch.autograd import DeviceType

    rows = sorted(((e.start_thread_id(), e.start_ns(), e.end_ns(), e.name()) for e in kineto_events
                   if e.device_type() == DeviceType.CPU and not e.is_async()),
                  key=lambda r: (r[0], r[1], -r[2]))
    spans: list[tuple[str, int, int]] = []
    children = []  # per span: the time its direct children took
    stack: list[int] = []  # the open ancestors of the current span, on its thread
    thread = None
    for tid, start, end, name in rows:
        if tid != thread:
            stack.clear()
            thread = tid
        while stack and spans[stack[-1]][2] <= start:
            stack.pop()
        if stack:
            children[stack[-1]] += end - start
        stack.append(len(spans))
        spans.append((name, start, end))
        children.append(0)
    return [(n, s, e, e - s - c) for (n, s, e), c in zip(spans, children, strict=True)]


def phase_tables(ops: list[tuple[str, int, int, int]], rows: int) -> list[str]:
    """For the last range of each phase: ``(op, self CPU ms, share of the phase's wall, calls)``, top ``rows``,
    from :func:`op_times`."""
    out = []
    for phase in PHASES:
        ranges = [(s, e) for n, s, e, _ in ops if n == phase]
        if not ranges:
            continue
        t0, t1 = ranges[-1]
        wall_ns = t1 - t0
        self_ns: dict[str, int] = defaultdict(int)
        calls: dict[str, int] = defaultdict(int)
        for name, s, e, own in ops:
            if name in PHASES or not (t0 <= s and e <= t1):
                continue
            self_ns[name] += own
            calls[name] += 1
        total = sum(self_ns.values())
        out.append(f"{phase}: {wall_ns / 1e6:.1f} ms wall, {total / 1e6:.1f} ms self CPU in ops (all threads)")
        out.append(f"  {'op':<64} {'self ms':>9} {'of phase':>9} {'calls':>7}")
        for name, ns in sorted(self_ns.items(), key=lambda kv: -kv[1])[:rows]:
            out.append(f"  {name[:64]:<64} {ns / 1e6:9.1f} {ns / wall_ns:9.1%} {calls[name]:7d}")
    return out


class OnePhase:
    """``--phase``: the profiler on during one phase of the last step only, through core's seam for it
    (:func:`unirl.trainer.phases.observed`).

    Why: the whole 100 M x 1024 step under the profiler records ~4.5 M events, and the profiler's own
    copy of them outgrew the machine's 23 GB before a table printed (two tries, both killed by the
    kernel). One phase at a time fits."""

    def __init__(self, phase: str, steps: int) -> None:
        self.phase, self.steps, self.seen = phase, steps, 0
        self.prof: Any = None

    @contextlib.contextmanager
    def __call__(self, name: str):
        if name != self.phase:
            yield
            return
        self.seen += 1
        if self.seen < self.steps:
            yield
            return
        with profile(activities=[ProfilerActivity.CPU], experimental_config=ALL_THREADS) as prof:
            yield
        self.prof = prof  # read after the step: reading the events here would count in the phase's time


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
    ap.add_argument("--phase", choices=["all", *(p.split(".")[1] for p in PHASES)], default="all",
                    help="profile this phase of the last step only (the 1024-token cells: the whole step's "
                         "events outgrow 23 GB)")
    args = ap.parse_args()
    if args.dtype == "bf16":  # as vs_trl.py's children: oneDNN's primitive cache bounded (read at its first use)
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    torch.set_num_threads(args.threads)
    from unirl.config import load_config
    from unirl.data.datasets import load_prompts
    from unirl.models.tokenizer import build_demo_tokenizer
    from unirl.trainer import phases
    from unirl.trainer.loop import train

    mm = mm_flops(dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    with tempfile.TemporaryDirectory() as out:
        config = load_config(None, overrides(out, args.steps, args.length, args.engine, args.checkpointing,
                                             args.size, args.dtype))
        one = OnePhase(args.phase, args.steps) if args.phase != "all" else None
        t0 = time.perf_counter()
        with phases.observed(one) if one is not None else profile(activities=[ProfilerActivity.CPU], experimental_config=ALL_THREADS) as whole:
            result = train(config, load_kernel(extra=[("vs_trl", Plugin(args.size))]))
        ops = op_times((whole if one is None else one.prof).profiler.kineto_results.events())
        wall = time.perf_counter() - t0
        prompts, _ = load_prompts(config, build_demo_tokenizer(), "train")
    last = result.history[-1]
    params = matmul_params(adapter_for(args.size)().build_model(config))
    tokens = PROMPTS * N * (args.length + statistics.mean(len(p.prompt_ids) for p in prompts[:PROMPTS]))
    print(f"cell {args.size} x {args.length} ({args.engine}, {args.dtype}): {params / 1e6:.1f} M matmul params, {tokens:.0f} "
          f"tokens/step, {args.threads} threads; {args.steps} steps in {wall:.0f} s, under the profiler: "
          f"{'every phase' if one is None else 'the ' + args.phase + ' phase of the last step'}; last step: " + ", ".join(f"{p[:-2]} {last[p]:.3f} s" for p in ("rollout_s", "replay_s", "train_s", "sync_s")))
    print(f"train phase: {6 * params * tokens / last['train_s'] / 1e9:.1f} GFLOP/s = "
          f"{6 * params * tokens / last['train_s'] / mm:.0%} of a plain {args.dtype} mm ({mm / 1e9:.1f} GFLOP/s, same process; "
          "profiler overhead included)")
    for line in phase_tables(ops, args.rows):
        print(line)


if __name__ == "__main__":
    main()
