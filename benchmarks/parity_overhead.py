"""What bitwise parity costs: seconds per GRPO step with ``UNIRL_PARITY_ENABLE=1`` against the same
recipe without it, on the embedded path (torch engine + torch actor), at the demo size and at a
~25 M-parameter Qwen3 (head_dim 64).

Each (size, side) run is a fresh process (the flag is read at process level, and the reference ops
are installed class-wide), and the sides are interleaved (off, on, off, on, ...) so that load on a
shared machine falls on both. Per run the first step is a warm-up and is dropped. Printed: per-phase
seconds (rollout / replay / train / sync), the on/off ratio of each and of the whole step, the same
ratios in process CPU time (rollout, train, step: they leave out the time the process waits for a
core, so they move less than wall time with other processes' load; not immune to it: a busy sibling
on a shared core still slows the work itself), and the
achieved FLOP/s of the replay and train phases (``2 x`` / ``6 x`` matmul parameters x tokens) beside
a plain ``torch.mm`` measured in the same process just before the run. Target: the whole step
<= 1.5x. The vLLM variant (``recipes/parity-tiny.yaml``) is not run here: it needs the vLLM side.

    python benchmarks/parity_overhead.py [--sizes demo,25m,moe] [--reps 2] [--steps 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "parity-tiny-embedded.yaml"
PHASES = ("rollout_s", "replay_s", "train_s", "sync_s")
TARGET = 1.5
#: size -> recipe overrides (the demo recipe as written, and a ~25 M-parameter Qwen3 on a smaller batch)
SIZES = {
    "demo": [],
    "25m": ["model.build.hidden_size=512", "model.build.intermediate_size=1536", "model.build.num_hidden_layers=8",
            "model.build.num_attention_heads=8", "model.build.num_key_value_heads=4", "model.build.head_dim=64",
            "trainer.prompts_per_step=4", "rollout.n=4"],
    # the tiny Qwen3-MoE (8 experts, top-2): routing + fixed-order expert combine (docs/parity.md, "MoE");
    # its printed FLOP/s counts the router and the top-k active experts per token (matmul_params)
    "moe": ["model.adapter=qwen3_moe"],
}


def matmul_flops(n: int = 5) -> float:
    """FLOP/s of a plain fp32 ``torch.mm`` (1024 x 512 @ 512 x 1536), best of ``n``."""
    import torch

    a, b = torch.randn(1024, 512), torch.randn(512, 1536)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(n))
    return 2 * 1024 * 512 * 1536 / best


def matmul_params(model) -> int:
    """Weights one token multiplies by in a forward (FLOPs ~ 2 x this per token): every ``nn.Linear``,
    and in a Qwen3-MoE sparse block the router (``[E, H]``) plus the ``top_k`` experts a token is
    routed to (``top_k x`` one expert's gate/up and down), not all ``E`` experts."""
    import torch

    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    try:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter
    except ImportError:  # pragma: no cover - transformers without Qwen3-MoE: a dense count
        return n
    top_k = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
    for m in model.modules():
        if isinstance(m, Qwen3MoeTopKRouter):
            n += m.weight.numel()
        elif isinstance(m, Qwen3MoeExperts):
            n += top_k * (m.gate_up_proj[0].numel() + m.down_proj[0].numel())
    return n


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def child(size: str, side: str, steps: int) -> dict:
    import torch

    from unirl.actor.torch_actor import TorchActor
    from unirl.config import load_config
    from unirl.engine.torch_engine import TorchEngine
    from unirl.kernel import load_kernel
    from unirl.trainer.loop import train

    tokens = {"train": [], "replay": []}

    def counting(method, key):
        def wrapped(self, samples, *a, **kw):
            tokens[key].append(sum(len(s.prompt_ids) + len(s.response_ids) for s in samples))
            return method(self, samples, *a, **kw)
        return wrapped

    TorchActor.train_step = counting(TorchActor.train_step, "train")
    TorchActor.logprobs = counting(TorchActor.logprobs, "replay")
    # process CPU time (all threads): leaves out time spent waiting for a core on a shared machine (see
    # the module doc). Rollout = the engine's generation; step = from one train_step's end to the next.
    cpu = {"rollout": 0.0, "rollout_at": [], "train": [], "marks": []}
    gen = TorchEngine._run

    def cpu_run(self, *a, **kw):
        t0 = time.process_time()
        try:
            return gen(self, *a, **kw)
        finally:
            cpu["rollout"] += time.process_time() - t0

    step_fn = TorchActor.train_step

    def cpu_train(self, *a, **kw):
        cpu["rollout_at"].append(cpu["rollout"])
        t0 = time.process_time()
        try:
            return step_fn(self, *a, **kw)
        finally:
            t1 = time.process_time()
            cpu["train"].append(t1 - t0)
            cpu["marks"].append(t1)

    TorchEngine._run = cpu_run
    TorchActor.train_step = cpu_train
    params = {}
    init = TorchActor.__init__

    def capture(self, *a, **kw):
        init(self, *a, **kw)
        params["matmul"] = matmul_params(self.model)
        params["all"] = sum(p.numel() for p in self.model.parameters())

    TorchActor.__init__ = capture
    flops = matmul_flops()
    with tempfile.TemporaryDirectory() as out:
        config = load_config(str(RECIPE), [f"run.output_dir={out}", f"trainer.steps={steps}", "trainer.plot=false",
                                           "trainer.progress=false", *SIZES[size],
                                           # the off side: the recipe's parity opt-in off too (preflight
                                           # refuses an opt-in without UNIRL_PARITY_ENABLE=1)
                                           *([] if os.environ.get("UNIRL_PARITY_ENABLE") == "1"
                                             else ["plugins.parity.enabled=false"])])
        result = train(config, load_kernel())
        verdict = None
        art = config.run_dir / "parity" / "artifact.json"
        if art.exists():
            verdict = json.loads(art.read_text())["verdict"]
    hist = [h for h in result.history if h["step"] > 1]  # step 1 warms caches
    steps_done = len(hist)
    marks, at = cpu["marks"], cpu["rollout_at"]
    cpu_s = {"rollout": [at[i] - at[i - 1] for i in range(1, len(at))][-steps_done:],
             "train": cpu["train"][1:][-steps_done:],
             "step": [marks[i] - marks[i - 1] for i in range(1, len(marks))][-steps_done:]}
    return {"size": size, "side": side, "threads": torch.get_num_threads(), "mm_flops": flops, "params": params,
            "phases": {p: [h[p] for h in hist] for p in PHASES}, "cpu_s": cpu_s,
            "rollout_tokens": [h["rollout_tokens"] for h in hist],
            "train_tokens": tokens["train"][-steps_done:], "replay_tokens": tokens["replay"][-steps_done:],
            "verdict": verdict}


def run_child(size: str, side: str, steps: int, threads: int | None = None) -> dict:
    env = dict(os.environ)
    if threads:  # e.g. 1 on a loaded shared machine: no OpenMP barriers across contended cores
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env.pop("UNIRL_PARITY_DIR", None)
    if side == "on":
        env["UNIRL_PARITY_ENABLE"] = "1"
    else:
        env.pop("UNIRL_PARITY_ENABLE", None)
    proc = subprocess.run([sys.executable, __file__, "--child", size, side, str(steps)], env=env, cwd=ROOT,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{size}/{side} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(size: str, runs: list[dict]) -> float:
    def mean(side, key):
        return statistics.mean(x for r in runs if r["side"] == side for x in r["phases"][key])

    def mean_of(side, field):
        return statistics.mean(x for r in runs if r["side"] == side for x in r[field])

    p = runs[0]["params"]
    print(f"\n== {size}: {p['all'] / 1e6:.2f} M params ({p['matmul'] / 1e6:.2f} M in matmuls), "
          f"{runs[0]['threads']} threads, {sum(len(r['phases']['train_s']) for r in runs if r['side'] == 'on')} "
          f"timed steps per side")
    print(f"{'phase':<10}{'off s':>9}{'on s':>9}{'on/off':>8}")
    tot = {}
    for side in ("off", "on"):
        tot[side] = sum(mean(side, k) for k in PHASES)
    for k in PHASES:
        off, on = mean("off", k), mean("on", k)
        print(f"{k[:-2]:<10}{off:>9.3f}{on:>9.3f}{on / off if off else float('nan'):>7.2f}x")
    ratio = tot["on"] / tot["off"]
    print(f"{'step':<10}{tot['off']:>9.3f}{tot['on']:>9.3f}{ratio:>7.2f}x   (target <= {TARGET}x)")
    cpu = {side: {k: statistics.mean(x for r in runs if r["side"] == side for x in r["cpu_s"][k])
                  for k in ("rollout", "train", "step")} for side in ("off", "on")}
    print("  process CPU time, on/off: " + ", ".join(
        f"{k} {cpu['off'][k]:.3f} -> {cpu['on'][k]:.3f} s {cpu['on'][k] / cpu['off'][k]:.2f}x"
        for k in ("rollout", "train", "step")))
    for side in ("off", "on"):
        mm = statistics.mean(r["mm_flops"] for r in runs if r["side"] == side)
        tr = 6 * p["matmul"] * mean_of(side, "train_tokens") / mean(side, "train_s")
        replayed = [x for r in runs if r["side"] == side for x in r["replay_tokens"]]
        # the trainer skips the pi_old replay when it is redundant (one update per batch): no replay rate
        rp = 2 * p["matmul"] * statistics.mean(replayed) / mean(side, "replay_s") if replayed else float("nan")
        print(f"  {side:>3}: train {tr / 1e9:6.2f} GFLOP/s, replay {rp / 1e9:6.2f} GFLOP/s; plain mm {mm / 1e9:6.1f} "
              f"GFLOP/s (train {tr / mm:.1%} of it); tokens/step train {mean_of(side, 'train_tokens'):.0f}, "
              f"rollout {mean_of(side, 'rollout_tokens'):.0f}")
    verdicts = sorted({str(r["verdict"]) for r in runs if r["side"] == "on"})
    print(f"  parity verdicts (on): {', '.join(verdicts)}")
    return ratio


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="demo,25m")
    ap.add_argument("--reps", type=int, default=2, help="runs per side, interleaved off/on")
    ap.add_argument("--steps", type=int, default=3, help="steps per run (the first is dropped)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")
    args = ap.parse_args()
    ratios = {}
    for size in args.sizes.split(","):
        runs = []
        for _ in range(args.reps):
            for side in ("off", "on"):
                runs.append(run_child(size, side, args.steps, args.threads))
                r = runs[-1]
                print(f"  {size}/{side}: step {sum(statistics.mean(r['phases'][k]) for k in PHASES):.2f} s "
                      f"(verdict {r['verdict']})", flush=True)
        ratios[size] = report(size, runs)
    print("\nratio (parity on / off, whole step): " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
