"""LoRA against full fine-tuning on the embedded actor: peak RSS and seconds per train step, ~25 M params.

Each side runs in a fresh process (so its peak RSS, ``VmHWM``, is its own), the two interleaved
(full, lora, full, lora, ... for ``--repeats``), on the same fp32 PPO batch and the same Qwen3 (hidden
512, 8 layers, head_dim 64: 25.2 M matmul parameters). The LoRA side is ``actor.lora`` (peft) with
``--rank`` on every linear layer. Per side it reports the median train-step time (after one warm-up
step, which also creates the AdamW state), the peak RSS, the trainable parameters and the AdamW state
bytes, and the achieved FLOP/s beside a plain ``torch.mm`` measured in the same process. Both sides
import peft first, so the RSS difference is the training state (gradients, AdamW), not an import; the
RSS after the imports and after the actor is built are printed beside the peak.

FLOPs per token: full fine-tuning is 6 N (forward 2 N, backward 4 N: activation and weight gradients);
LoRA still back-propagates through every frozen layer but computes no weight gradient for it, so about
4 N (the adapter's own FLOPs are r / hidden of that and are left out). The ratios are LoRA / full from
the same run.

    python benchmarks/lora_vs_full.py [--steps 4] [--repeats 2] [--rank 16] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from unirl.api import default_runtime


def peak_rss_mb() -> float:
    """This process's peak RSS: ``VmHWM`` (``ru_maxrss`` would carry the parent's peak across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def mm_flops() -> float:
    """The plain matmul's FLOP/s at this model's width (the sibling step benchmark's one copy; imported
    here, after training, so it adds nothing to the RSS the sides are compared on)."""
    from grpo_step_vs_floor import mm_flops as plain_mm

    return plain_mm(4480, 512, 1536)


def config(args, side: str):
    from unirl.config import RunConfig

    actor = {"lr": 1e-5, "micro_batch_size": args.samples}
    if side == "lora":
        actor["lora"] = {"r": args.rank, "alpha": 2 * args.rank}
    return RunConfig.model_validate({
        "model": {"build": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
                            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}},
        "actor": actor, "trainer": {"steps": 100},
    })


def batch(args):
    import torch

    from unirl.samples import Sample

    rng = random.Random(0)
    samples = [Sample(id=f"p{i // 4}/{i % 4}", prompt_ids=[rng.randrange(3, 259) for _ in range(args.prompt_len)],
                      response_ids=[rng.randrange(3, 259) for _ in range(args.response_len)],
                      loss_mask=[1] * args.response_len) for i in range(args.samples)]
    g = torch.Generator().manual_seed(0)
    tensors = {"advantages": [torch.randn(args.response_len, generator=g) for _ in samples],
               "old_logprobs": [torch.full((args.response_len,), -5.5) for _ in samples]}
    return samples, tensors


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def child(args) -> dict:
    import peft  # noqa: F401 - both sides import it, so the RSS difference is the training state, not imports
    import torch

    torch.set_num_threads(args.threads)
    from unirl.actor.torch_actor import TorchActor
    from unirl.models.qwen3 import Qwen3Adapter

    imports_mb = rss_mb()
    cfg = config(args, args.child)
    actor = TorchActor(config=cfg, runtime=default_runtime(cfg), adapter=Qwen3Adapter())
    built_mb = rss_mb()
    samples, tensors = batch(args)
    actor.train_step(samples, tensors)  # warm-up: AdamW state is created here
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        actor.train_step(samples, tensors)
        times.append(time.perf_counter() - t)
    trainable = [p for g in actor.optimizer.param_groups for p in g["params"]]
    state_bytes = sum(v.numel() * v.element_size() for s in actor.optimizer.state.values() for v in s.values()
                      if torch.is_tensor(v))
    base = actor.model.get_base_model() if cfg.actor.lora is not None else actor.model
    seen, n = set(), 0
    for name, m in base.named_modules():
        w = getattr(m, "weight", None)
        if isinstance(m, torch.nn.Linear) and ".lora_" not in name and w.data_ptr() not in seen:
            seen.add(w.data_ptr())
            n += w.numel()
    return {"side": args.child, "step_s": statistics.median(times), "steps": times, "rss_mb": peak_rss_mb(),
            "imports_mb": imports_mb, "built_mb": built_mb,
            "trainable": sum(p.numel() for p in trainable), "optim_mb": state_bytes / 2**20, "matmul_params": n,
            "tokens": args.samples * (args.prompt_len + args.response_len), "mm": mm_flops()}


def run_child(args, side: str) -> dict:
    cmd = [sys.executable, __file__, "--child", side, "--steps", str(args.steps), "--rank", str(args.rank),
           "--threads", str(args.threads), "--samples", str(args.samples), "--prompt-len", str(args.prompt_len),
           "--response-len", str(args.response_len)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "CI": ""})
    if out.returncode != 0:
        raise SystemExit(f"{side} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="timed train steps per side (after one warm-up)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved fresh-process runs per side")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank), every linear layer")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--child", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    runs: dict[str, list[dict]] = {"full": [], "lora": []}
    for _ in range(args.repeats):
        for side in ("full", "lora"):
            runs[side].append(run_child(args, side))
    res = {}
    for side, rs in runs.items():
        step = statistics.median(r["step_s"] for r in rs)
        n, tokens, mm = rs[0]["matmul_params"], rs[0]["tokens"], max(r["mm"] for r in rs)
        flops = (6 if side == "full" else 4) * n * tokens / step
        res[side] = {"step_s": step, "rss_mb": max(r["rss_mb"] for r in rs), "flops": flops, "mm": mm,
                     "growth_mb": max(r["rss_mb"] - r["built_mb"] for r in rs), **{
                         k: rs[0][k] for k in ("trainable", "optim_mb", "matmul_params", "tokens", "imports_mb",
                                               "built_mb")}}
        each = ", ".join(f"{r['step_s']:.3f}" for r in rs)
        print(f"{side:>4}: {step:.3f} s/step (runs {each}; steps {rs[0]['steps']}), peak RSS "
              f"{res[side]['rss_mb']:.0f} MB (imports {res[side]['imports_mb']:.0f}, actor built "
              f"{res[side]['built_mb']:.0f}, training adds {res[side]['growth_mb']:.0f}), trainable {res[side]['trainable'] / 1e6:.2f} M of "
              f"{n / 1e6:.1f} M matmul params, AdamW state {res[side]['optim_mb']:.1f} MB; "
              f"{flops / 1e9:.1f} GFLOP/s = {flops / mm:.0%} of a plain mm ({mm / 1e9:.0f} GFLOP/s)")
    f, lo = res["full"], res["lora"]
    print(f"LoRA r={args.rank} / full, same run ({args.samples} x {args.prompt_len}+{args.response_len} tokens, "
          f"{args.threads} threads, {args.repeats} repeat(s)): step time {lo['step_s'] / f['step_s']:.2f}x, "
          f"peak RSS {lo['rss_mb'] / f['rss_mb']:.2f}x (what training adds to it: "
          f"{lo['growth_mb'] / f['growth_mb']:.2f}x), AdamW state {lo['optim_mb'] / f['optim_mb']:.3f}x, "
          f"trainable params {lo['trainable'] / f['trainable']:.3f}x")


if __name__ == "__main__":
    main()
