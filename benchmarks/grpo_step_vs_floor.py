"""Seconds per GRPO step, ``unirl train`` (embedded engine + actor) against a plain-PyTorch floor, on
the step-speed workload, in interleaved rounds in one process.

Workload (both sides): a tiny Qwen3 built by code (hidden 256, intermediate 768, 4 layers, 8 heads, 4 KV
heads, head_dim 32, vocab 512, tied, fp32: 3.3 M parameters); 16 prompts x 4 samples x 64 new tokens
(eos ignored, so every response is 64 tokens); one optimizer step per batch.

* **UniRL**: one ``unirl.trainer.loop.train`` run with the recipe defaults (``actor.micro_batch_size``
  left at its default: no recipe tuning) and ``rollout.ignore_eos: true``. Its per-step phases are the
  trainer's own ``rollout_s`` / ``replay_s`` / ``train_s`` / ``sync_s``.
* **floor**: a GRPO step written here in plain PyTorch: HF ``generate`` (sampling, ``output_scores``),
  group-normalised advantages, one padded forward + backward of the PPO-clip loss with the forward's own
  detached log-probs as pi_old (no replay), AdamW. It runs inside the trainer's ``unirl_on_step_end``
  hook, so the two sides alternate step by step in one process; the first step of each is warm-up.

Printed: the per-phase breakdown, the ratio UniRL / floor (issue target <= 0.8, stretch 0.7), each
side's achieved FLOP/s (6 N T for forward + backward, 2 N T for decode, N = matmul parameters) as a
fraction of a 4480 x 256 x 768 fp32 ``torch.mm`` measured between the rounds, and peak RSS of each
side alone in a fresh process (``VmHWM``; skip with ``--no-rss``). ``--quick`` is 3 rounds, no RSS.

If the trainer ran a real pi_old replay (``replay_s`` above 2 % of the step: the shortcut of
:mod:`unirl.trainer.replay` did not apply), the ratio without it is printed too. The machine is
usually shared: run ``uptime`` beside it and compare only ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from unirl.kernel import hookimpl, load_kernel
from unirl.models.qwen3 import Qwen3Adapter

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, vocab_size=512, tie_word_embeddings=True,
             max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6)
PROMPTS, N, NEW = 16, 4, 64
PHASES = ("rollout_s", "replay_s", "train_s", "sync_s")
FLOOR_PHASES = ("generate_s", "train_s", "opt_s")


class BenchAdapter(Qwen3Adapter):
    """The issue's model, built by code: the qwen3 adapter with :data:`MODEL` (vocabulary 512; the demo
    tokenizer's 259 ids fit in it)."""

    name = "bench_qwen3"

    def hf_config(self, config, tokenizer=None, **overrides):
        return super().hf_config(config, tokenizer, **{**MODEL, **overrides})


def recipe(out: str, steps: int) -> list[str]:
    return [
        f"run.output_dir={out}", "run.name=bench", "model.adapter=bench_qwen3",
        "model.dtype=float32", "data.source=arith", "data.arith.n_eval=4", f"rollout.n={N}",
        f"rollout.max_new_tokens={NEW}", "rollout.ignore_eos=true", "rollout.temperature=1.0",
        f"trainer.prompts_per_step={PROMPTS}", f"trainer.steps={steps}", "trainer.eval_every=0",
        "trainer.eval_k=1", "trainer.plot=false", "trainer.progress=false", "sft.steps=0",
        "algorithm.updates_per_batch=1", "algorithm.old_logp_source=replay",
    ]


def peak_rss_mb() -> float:
    """This process's peak RSS: ``VmHWM`` (``ru_maxrss`` would carry the parent's peak across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in a matmul per token: every Linear (the tied lm_head once)."""
    seen, n = set(), 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.data_ptr() not in seen:
            seen.add(m.weight.data_ptr())
            n += m.weight.numel()
    return n


def mm_flops(m: int = 4480, k: int = 256, n: int = 768, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a plain ``[m, k] @ [k, n]`` matmul in ``dtype``, best of 3 x 5 (the ceiling the train phase
    is set against; the other benchmarks import it with their own shapes)."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(5):
            a @ b
        best = min(best, (time.perf_counter() - t) / 5)
    return 2 * m * k * n / best


# ------------------------------------------------------------------------------------------ floor


class Floor:
    """The plain-PyTorch GRPO step: HF generate with scores, one padded fwd + bwd, AdamW."""

    def __init__(self, config, tokenizer) -> None:
        from unirl.data.datasets import load_prompts

        self.model = BenchAdapter().build_model(config, tokenizer)  # same seed: the same initial weights
        self.model.generation_config.eos_token_id = None  # eos ignored: 64 tokens per response
        self.model.generation_config.pad_token_id = tokenizer.pad_token_id
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=config.actor.lr)
        prompts, _ = load_prompts(config, tokenizer, "train")
        self.prompts = [p.prompt_ids for p in prompts[:PROMPTS]]
        self.pad = tokenizer.pad_token_id
        self.tokens = PROMPTS * N * (NEW + statistics.mean(len(p) for p in self.prompts))

    def step(self, seed: int) -> dict[str, float]:
        m, out = self.model, {}
        P = max(len(p) for p in self.prompts)
        ids = torch.full((PROMPTS * N, P), self.pad, dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, p in enumerate(self.prompts):
            for j in range(N):
                ids[i * N + j, P - len(p):] = torch.tensor(p)
                att[i * N + j, P - len(p):] = 1
        t0 = time.perf_counter()
        m.eval()
        torch.manual_seed(seed)
        with torch.no_grad():
            g = m.generate(input_ids=ids, attention_mask=att, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           max_new_tokens=NEW, min_new_tokens=NEW, output_scores=True, return_dict_in_generate=True)
        seq = g.sequences
        scores = torch.stack(g.scores, 1).float()  # [B, NEW, V]
        resp = seq[:, P:]
        _ = torch.log_softmax(scores, -1).gather(-1, resp[..., None])[..., 0]  # rollout log-probs
        reward = (resp[:, 0] % 2).float()  # any per-sample reward: GRPO only needs it per group
        r = reward.view(PROMPTS, N)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).reshape(-1)
        out["generate_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        m.train()
        full_att = torch.cat([att, torch.ones_like(resp)], 1)
        logits = m(input_ids=seq, attention_mask=full_att, use_cache=False).logits[:, P - 1:-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, resp[..., None])[..., 0]
        ratio = torch.exp(logp - logp.detach())
        a = adv[:, None]
        loss = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a).mean()
        loss.backward()
        out["train_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        out["opt_s"] = time.perf_counter() - t0
        return out


# ------------------------------------------------------------------------------------------ the run


class Bench:
    """The in-process plugin: the model adapter, and the floor step after every trainer step."""

    def __init__(self, side: str) -> None:
        self.side, self.floor, self.floor_steps, self.mm = side, None, [], []
        self.config = self.tokenizer = None

    @hookimpl
    def unirl_model_adapters(self):
        return {"bench_qwen3": BenchAdapter}

    @hookimpl
    def unirl_on_step_end(self, step, metrics, config):
        if self.side != "both":
            return
        if self.floor is None:
            from unirl.models.tokenizer import build_demo_tokenizer

            self.floor = Floor(config, build_demo_tokenizer())
        self.floor_steps.append(self.floor.step(seed=step))
        self.mm.append(mm_flops())


def run(side: str, rounds: int) -> dict[str, Any]:
    from unirl.config import load_config
    from unirl.trainer.loop import train

    bench = Bench(side)
    with tempfile.TemporaryDirectory() as out:
        if side == "floor":
            from unirl.models.tokenizer import build_demo_tokenizer

            config = load_config(None, recipe(out, rounds))
            floor = Floor(config, build_demo_tokenizer())
            steps = [floor.step(seed=i) for i in range(rounds)]
            return {"floor": steps, "rss_mb": peak_rss_mb()}
        config = load_config(None, recipe(out, rounds))
        result = train(config, load_kernel(extra=[("bench", bench)]))
    model = BenchAdapter().build_model(config)
    return {"unirl": result.history[1:], "floor": bench.floor_steps, "mm": bench.mm,
            "params": matmul_params(model), "micro_batch_size": config.actor.micro_batch_size,
            "rss_mb": peak_rss_mb(),
            "tokens": bench.floor.tokens if bench.floor else 0}


def child_rss(side: str, rounds: int, threads: int) -> float:
    cmd = [sys.executable, __file__, "--child", side, "--rounds", str(rounds), "--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "CI": ""})
    return json.loads(out.stdout.strip().splitlines()[-1])["rss_mb"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6, help="interleaved steps per side (the first is warm-up)")
    ap.add_argument("--quick", action="store_true", help="3 rounds, no fresh-process RSS")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-rss", action="store_true", help="skip the fresh-process peak RSS of each side")
    ap.add_argument("--child", choices=["unirl", "floor"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps({"rss_mb": run(args.child, args.rounds)["rss_mb"]}))
        return
    rounds = 3 if args.quick else args.rounds
    res = run("both", rounds)
    u = res["unirl"][1:]  # step 1 warms caches
    f = res["floor"][1:]
    phase = {p: statistics.mean(h[p] for h in u) for p in PHASES}
    fphase = {p: statistics.mean(h[p] for h in f) for p in FLOOR_PHASES}
    ut, ft = sum(phase.values()), sum(fphase.values())
    print(f"workload: tiny Qwen3 {res['params'] / 1e6:.2f} M matmul params, {PROMPTS} prompts x {N} samples x {NEW} "
          f"new tokens, fp32, {args.threads} threads; actor.micro_batch_size={res['micro_batch_size']} (default); "
          f"{len(u)} timed rounds after 1 warm-up")
    print(f"{'UniRL phase':<14}{'s/step':>9}   {'floor phase':<14}{'s/step':>9}")
    rows = max(len(PHASES), len(FLOOR_PHASES))
    for i in range(rows):
        left = f"{PHASES[i][:-2]:<14}{phase[PHASES[i]]:>9.3f}" if i < len(PHASES) else " " * 23
        right = f"{FLOOR_PHASES[i][:-2]:<14}{fphase[FLOOR_PHASES[i]]:>9.3f}" if i < len(FLOOR_PHASES) else ""
        print(f"{left}   {right}")
    print(f"{'total':<14}{ut:>9.3f}   {'total':<14}{ft:>9.3f}")
    per_round = [sum(h[p] for p in PHASES) / sum(g.values()) for h, g in zip(u, f, strict=True)]
    print(f"ratio UniRL / floor: {ut / ft:.2f}  (per round: {', '.join(f'{r:.2f}' for r in per_round)}; "
          "target <= 0.8, stretch 0.7)")
    if phase["replay_s"] > 0.02 * ut:  # the shortcut of unirl.trainer.replay leaves ~2 ms of bookkeeping
        print(f"  the pi_old replay ran ({phase['replay_s']:.3f} s/step: the shortcut of unirl.trainer.replay did not "
              f"apply); without it: {(ut - phase['replay_s']) / ft:.2f}")
    n, tokens = res["params"], res["tokens"]
    flops = 6 * n * tokens + 2 * n * PROMPTS * N * NEW
    mm = max(res["mm"])
    print(f"step FLOPs {flops / 1e9:.0f} G (fwd+bwd {6 * n * tokens / 1e9:.0f}, decode {2 * n * PROMPTS * N * NEW / 1e9:.0f}); "
          f"plain mm {mm / 1e9:.0f} GFLOP/s (best of the rounds)")
    print(f"achieved: UniRL {flops / ut / 1e9:.1f} GFLOP/s = {flops / ut / mm:.0%} of mm; "
          f"floor {flops / ft / 1e9:.1f} GFLOP/s = {flops / ft / mm:.0%} of mm; "
          f"train phase: UniRL {6 * n * tokens / phase['train_s'] / mm:.0%}, floor "
          f"{6 * n * tokens / (fphase['train_s'] + fphase['opt_s']) / mm:.0%}")
    print(f"peak RSS of this process (both sides): {res['rss_mb']:.0f} MB")
    if not (args.quick or args.no_rss):
        r_u, r_f = child_rss("unirl", 2, args.threads), child_rss("floor", 2, args.threads)
        print(f"peak RSS alone, fresh process, 2 steps: UniRL {r_u:.0f} MB, floor {r_f:.0f} MB ({r_u / r_f:.2f}x)")
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} (1/5/15 min)")


if __name__ == "__main__":
    main()
