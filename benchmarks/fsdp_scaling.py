"""FSDP actor scaling: step time and memory per rank, 1 rank against 2, on a ~25 M-parameter Qwen3.

Both layouts get the same 2 CPU cores (1 rank x 2 threads, or 2 ranks x 1 thread), the same batch and
the same fp32 PPO step (gloo). Per rank it reports the peak RSS and the bytes it holds in parameters,
gradients and AdamW state (counted from the tensors, so Python/torch/Ray overhead is excluded).

Target: with 2 ranks, parameter + gradient + optimizer memory per rank <= 0.6x that of 1 rank
(FSDP shards all three, so the ideal is 0.5x). Step time on 2 cores is not expected to improve: the
same FLOPs are split over the same cores, plus gloo collectives; the point of FSDP here is memory, and
on GPUs, more devices.

    python benchmarks/fsdp_scaling.py [--steps 3] [--layers 8] [--hidden 512]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

MEMORY_TARGET = 0.6
#: the memory probe is test support, not production code: a worker subclass the ranks run
SUPPORT = Path(__file__).resolve().parents[1] / "plugins" / "unirl-fsdp" / "tests"


def build_config(args, world_size: int):
    from unirl.config import RunConfig

    heads = args.hidden // 64
    return RunConfig.model_validate({
        "model": {"build": {"hidden_size": args.hidden, "intermediate_size": 3 * args.hidden,
                            "num_hidden_layers": args.layers, "num_attention_heads": heads,
                            "num_key_value_heads": max(1, heads // 2), "head_dim": 64}},
        "actor": {"name": "fsdp", "micro_batch_size": args.micro_batch_size, "lr": 1e-5,
                  "options": {"world_size": world_size, "cpus_per_rank": 2 / world_size,
                              "step_timeout_s": 900, "init_timeout_s": 600,
                              "worker_cls": "fsdp_support:DrillWorker"}},
    })


def make_batch(args):
    import torch

    from unirl.samples import Sample

    rng = random.Random(0)
    samples = []
    for i in range(args.samples):
        prompt = [rng.randrange(3, 259) for _ in range(args.prompt_len)]
        resp = [rng.randrange(3, 259) for _ in range(args.response_len)]
        samples.append(Sample(id=f"p{i // 4}/{i % 4}", prompt_ids=prompt, response_ids=resp,
                              loss_mask=[1] * len(resp)))
    g = torch.Generator().manual_seed(0)
    batch = {"advantages": [torch.randn(args.response_len, generator=g) for _ in samples],
             "old_logprobs": [torch.full((args.response_len,), -5.5) for _ in samples]}
    return samples, batch


def run(args, world_size: int) -> dict:
    sys.path.insert(0, str(SUPPORT))
    import fsdp_support

    from unirl.kernel import load_kernel
    from unirl.models.qwen3 import Qwen3Adapter
    from unirl.runtime import build_runtime
    from unirl.testing import build_actor

    samples, batch = make_batch(args)
    config = build_config(args, world_size)
    runtime = build_runtime(config, load_kernel(), adapter=Qwen3Adapter(), worker_env={})
    t0 = time.perf_counter()
    actor = build_actor(config, adapter=Qwen3Adapter(), runtime=runtime)
    try:
        start_s = time.perf_counter() - t0
        actor.train_step(samples, batch)  # warm-up (optimizer state is created here)
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            actor.train_step(samples, batch)
            times.append(time.perf_counter() - t)
        mem = fsdp_support.memory(actor)
        return {"world_size": world_size, "params": actor.num_params, "start_s": start_s,
                "step_s": statistics.median(times), "mem": mem}
    finally:
        actor.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--response-len", type=int, default=48)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    args = ap.parse_args()

    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False,
             log_to_driver=False)
    try:
        results = [run(args, 1), run(args, 2)]
    finally:
        ray.shutdown()

    one, two = results
    print(f"model: {one['params'] / 1e6:.1f} M params, fp32 master + AdamW, gloo, 2 CPU cores; "
          f"batch {args.samples} x ({args.prompt_len}+{args.response_len}) tokens, "
          f"micro-batch {args.micro_batch_size}")
    print(f"{'ranks':>5} {'rank':>4} {'step s':>8} {'start s':>8} {'peak RSS MB':>12} {'after setup':>12} "
          f"{'params MB':>10} {'grads MB':>9} {'optim MB':>9} {'p+g+o MB':>9}")

    def state_mb(m: dict) -> float:
        return 2 * m["param_mb"] + m["optim_mb"]  # grads are as large as the params they belong to

    for r in results:
        for m in r["mem"]:
            print(f"{r['world_size']:>5} {m['rank']:>4} {r['step_s']:>8.3f} {r['start_s']:>8.1f} "
                  f"{m['peak_rss_mb']:>12.0f} {m['setup_rss_mb']:>12.0f} "
                  f"{m['param_mb']:>10.1f} {m['param_mb']:>9.1f} {m['optim_mb']:>9.1f} {state_mb(m):>9.1f}")
    step_ratio = two["step_s"] / one["step_s"]
    state_ratio = max(state_mb(m) for m in two["mem"]) / state_mb(one["mem"][0])
    rss_ratio = max(m["peak_rss_mb"] for m in two["mem"]) / one["mem"][0]["peak_rss_mb"]
    growth_ratio = (max(m["peak_rss_mb"] - m["setup_rss_mb"] for m in two["mem"])
                    / max(1.0, one["mem"][0]["peak_rss_mb"] - one["mem"][0]["setup_rss_mb"]))
    print(f"step time ratio (2 ranks / 1 rank): {step_ratio:.2f}x")
    print(f"param+grad+optimizer memory per rank ratio: {state_ratio:.2f}x "
          f"(target <= {MEMORY_TARGET}x -> {'met' if state_ratio <= MEMORY_TARGET else 'MISSED'})")
    print(f"peak RSS per rank ratio: {rss_ratio:.2f}x (includes ~the Python/torch/Ray baseline per process)")
    print(f"training RSS growth per rank ratio: {growth_ratio:.2f}x (peak RSS - peak RSS after setup, i.e. "
          "after imports and the full-model build that precedes sharding)")


if __name__ == "__main__":
    main()
