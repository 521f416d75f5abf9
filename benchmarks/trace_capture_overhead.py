"""Rollout time with trace capture on against off (unirl-replay-trace). Target: <= 1.03x.

One embedded torch engine on the tiny Qwen3 serves both sides; rounds alternate off / on (interleaved,
so machine load hits both alike). A round is one rollout batch as the trainer runs it: ``generate``
on ``prompts x n`` fresh samples, plus, when capture is on, the exporter's ``record`` (request ids,
lengths, chained block hashes, times). Same seeds on both sides, so both generate the same tokens.
The engine's per-request timing (each row stamped at the decode step it ended) is part of
both sides; its cost (one clock read per decode step) is printed on its own line.
Two ratios: the interleaved wall-time ratio, and (rollout off + the measured ``record`` time) /
rollout off, the cost capture adds by construction, which stays readable when load makes the wall
times of the two sides scatter by more than the capture costs. ``close`` (writing the trace files) runs once at the end of a run, not per rollout; it is reported
separately.

    .venv/bin/python benchmarks/trace_capture_overhead.py [--rounds 6] [--prompts 16] [--n 4] [--tokens 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="rounds per side (interleaved)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per sample")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared, loaded machine oversubscribes 2 badly)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from unirl.config import load_config
    from unirl.contracts import SamplingParams
    from unirl.data.datasets import load_prompts
    from unirl.kernel.manager import load_kernel
    from unirl.samples import expand
    from unirl.trainer.loop import build_components

    out = tempfile.mkdtemp(prefix="trace-bench-")
    config = load_config(ROOT / "recipes" / "arith-tiny.yaml",
                         [f"run.output_dir={out}", "run.name=bench", "trace.exporter=dynamo-agentic",
                          "trainer.progress=false"])
    c = build_components(config, load_kernel())
    prompts, _ = load_prompts(config, c.tokenizer, "train")
    prompts = prompts[:args.prompts]
    # no stop tokens: every sample generates exactly --tokens, so both sides do the same work
    sampling = SamplingParams(max_new_tokens=args.tokens, temperature=1.0, stop_token_ids=())
    exporter = load_kernel().build("trace_exporters", "dynamo-agentic", options=config.trace.options,
                                   options_at="trace.options", config=config)
    times: dict[str, list[float]] = {"off": [], "on": []}
    record_ms: list[float] = []
    try:
        c.engine.generate(expand(prompts, args.n, tag="warm", base_seed=1), sampling)  # warm-up
        for i in range(2 * args.rounds):
            side = ("off", "on")[i % 2] if (i // 2) % 2 == 0 else ("on", "off")[i % 2]  # ABBA order
            samples = expand(prompts, args.n, tag=f"train-{i}", seed_tag=f"r{i // 2}", base_seed=7)
            t0 = time.perf_counter()
            c.engine.generate(samples, sampling)
            if side == "on":
                t1 = time.perf_counter()
                exporter.record(phase="train", step=i, version=c.engine.weight_version, samples=samples)
                record_ms.append((time.perf_counter() - t1) * 1000.0)
            times[side].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        trace = exporter.close()
        close_s = time.perf_counter() - t0
    finally:
        c.close()
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    n_req = args.prompts * args.n
    print(f"trace capture overhead: {args.rounds} rounds per side, interleaved ABBA; "
          f"{args.prompts} prompts x {args.n} = {n_req} requests x {args.tokens} tokens, embedded torch engine, "
          f"{args.threads} threads")
    print(f"  rollout off: median {off * 1000:.1f} ms (min {min(times['off']) * 1000:.1f})")
    print(f"  rollout on:  median {on * 1000:.1f} ms (min {min(times['on']) * 1000:.1f})")
    print(f"  record(): median {statistics.median(record_ms):.2f} ms per batch "
          f"({statistics.median(record_ms) * 1000 / n_req:.1f} us per request)")
    direct = (off + statistics.median(record_ms) / 1000.0) / off
    print(f"  ratio on/off, interleaved wall time (median): {on / off:.3f}x; of mins: "
          f"{min(times['on']) / min(times['off']):.3f}x  (noisy on a loaded machine: the sides differ only by record())")
    print(f"  ratio (rollout off + record()) / rollout off: {direct:.5f}x   [target <= 1.03x]")
    print(f"  close() (once per run, writes {trace}): {close_s * 1000:.1f} ms")
    # per-request timing is on in both sides: the engine reads the clock once per decode step
    # (not per row), so its cost is steps x one clock read, shown against the rollout
    import timeit

    from unirl.samples import now_ms

    clock_us = min(timeit.repeat(now_ms, number=100_000, repeat=3)) / 100_000 * 1e6
    per_batch_ms = clock_us * (args.tokens + 1) / 1000.0
    print(f"  per-request timing in the engine: {args.tokens + 1} clock reads per batch x {clock_us:.3f} us = "
          f"{per_batch_ms * 1000:.1f} us per batch ({per_batch_ms / (off * 1000.0) * 100:.4f} % of the rollout)")
    print("  load: " + subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
