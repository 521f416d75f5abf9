"""LoRA weight sync to vLLM: merged weights against the adapter alone (``actor.lora.sync``), per step.

Why both sync and rollout: the adapter sync moves r x (in + out) numbers per adapted layer instead of
the whole model, but vLLM then serves every request through its LoRA path (punica kernels on top of
the base matmuls), which on the CPU costs rollout time. What decides the default is the whole step.

Each mode runs ``train()`` of the vLLM demo recipe (``recipes/arith-tiny-vllm.yaml``, vLLM in the
trainer's process) in a fresh process, interleaved (merged, adapter, merged, ... for ``--repeats``),
on the same seed, model and batch, with ``sft.steps=0``, no eval and ``ignore_eos`` (every sample
generates ``max_new_tokens``, so both modes roll out and train on the same number of tokens). The model is a Qwen3 built from
``--hidden`` / ``--layers`` (head_dim 64). Per mode it prints every step's ``sync_s``, ``rollout_s``,
``replay_s``, ``train_s`` and their sum, then the medians over steps after the first (warm-up) and the
ratio adapter / merged, also of ``sync_s + rollout_s``: the phases the mode changes (replay and train
are the same work in both, so under load their spread can swamp the step ratio). One line of JSON per mode at the end (``--json``).

    python benchmarks/lora_sync.py [--steps 4] [--repeats 1] [--rank 16] [--hidden 512] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("sync_s", "rollout_s", "replay_s", "train_s")
OTHER = ("rollout_tokens",)


def overrides(args: argparse.Namespace, mode: str, out: str) -> list[str]:
    heads = max(1, args.hidden // 64)
    return [f"run.output_dir={out}", "trainer.progress=false", "trainer.plot=false", f"trainer.steps={args.steps}",
            "trainer.eval_every=0", "trainer.eval_k=1", "sft.steps=0", f"trainer.prompts_per_step={args.prompts}",
            "algorithm.updates_per_batch=1", "actor.lr=1e-3", f"actor.micro_batch_size={args.prompts * 8}",
            f"model.build={{hidden_size: {args.hidden}, intermediate_size: {3 * args.hidden}, "
            f"num_hidden_layers: {args.layers}, num_attention_heads: {heads}, num_key_value_heads: "
            f"{max(1, heads // 2)}, head_dim: 64}}",
            f"actor.lora={{r: {args.rank}, alpha: {2 * args.rank}, sync: {mode}}}",
            "rollout.options={placement: inprocess, kv_cache_gb: 0.5, max_model_len: 128, ignore_eos: true}"]


def child(args: argparse.Namespace) -> None:
    """One mode's run, in this (fresh) process; prints one JSON line."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))
    import torch

    torch.set_num_threads(args.threads)
    from unirl.api import load_config, load_kernel, train

    with tempfile.TemporaryDirectory(prefix="lora-sync-") as out:
        config = load_config(ROOT / "recipes" / "arith-tiny-vllm.yaml", overrides(args, args.mode, out))
        result = train(config, load_kernel())
        steps = [{k: float(h.get(k, 0.0)) for k in PARTS + OTHER} for h in result.history if h["step"] > 0]
        log = (result.run_dir / "weights.log").read_text().splitlines()
    print(json.dumps({"mode": args.mode, "steps": steps, "weights_log": log}), flush=True)


def summary(mode: str, runs: list[dict]) -> dict:
    steps = [s for r in runs for s in r["steps"][1:]]  # the first step of each run warms up
    med = {k: statistics.median(s[k] for s in steps) for k in PARTS}
    med["step_s"] = statistics.median(sum(s[k] for k in PARTS) for s in steps)
    # the phases the sync mode changes (replay and train are the same work in both modes)
    med["sync_rollout_s"] = statistics.median(s["sync_s"] + s["rollout_s"] for s in steps)
    return {"mode": mode, "n": len(steps), **{k: round(v, 4) for k, v in med.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (x rollout.n 8 samples)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", choices=["merged", "adapter"], help=argparse.SUPPRESS)  # the child
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.mode:
        return child(args)
    runs: dict[str, list[dict]] = {"merged": [], "adapter": []}
    for _ in range(args.repeats):
        for mode in runs:
            cmd = [sys.executable, __file__, "--mode", mode] + [f"--{k}={getattr(args, k)}" for k in
                                                               ("steps", "rank", "hidden", "layers", "prompts", "threads")]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
            run = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])
            runs[mode].append(run)
            print(f"== {mode} (hidden {args.hidden}, {args.layers} layers, r {args.rank})")
            for line in run["weights_log"]:
                print("   ", line.split(" ", 1)[1])
            for i, s in enumerate(run["steps"], 1):
                print(f"   step {i}: " + "  ".join(f"{k} {s[k]:.3f}" for k in PARTS) +
                      f"  total {sum(s[k] for k in PARTS):.3f}  ({s.get('rollout_tokens', 0):.0f} tokens)")
    sums = [summary(m, r) for m, r in runs.items()]
    m, a = sums
    print("\nmedian over steps after the first:")
    for s in sums:
        print(f"  {s['mode']:8s} " + "  ".join(f"{k} {s[k]:.3f}" for k in (*PARTS, "sync_rollout_s", "step_s")))
    print("  adapter / merged: " + "  ".join(f"{k} {a[k] / m[k]:.2f}x" for k in (*PARTS, "sync_rollout_s", "step_s") if m[k]))
    if args.json:
        for s in sums:
            print(json.dumps(s))


if __name__ == "__main__":
    main()
