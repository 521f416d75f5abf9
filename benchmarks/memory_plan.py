"""The memory plan (``unirl plan``) against measurement: predicted per-rank peak vs measured peak RSS.

Why: a plan that is not held against what a process really holds is a guess. Each cell runs ``unirl
train`` (2 GRPO steps, no SFT) on a Qwen3 built from ``model.build`` at a given size, with the embedded
actor or the FSDP actor on N gloo ranks, fp32 or bf16 compute, and reads the run's per-phase memory
report (``RUN_DIR/memory.json``: each phase's peak RSS in the trainer's process and in each rank). The
measured figure is the largest phase peak minus the same layout's peak with the tiny default model (the
process's baseline: Python, torch, Ray, gloo, the tokenizer, the data), so it is the model's own memory,
which is what the plan predicts. The prediction is :func:`unirl.memory_plan.plan` for the same recipe.

    python benchmarks/memory_plan.py --measure out.json            # runs the cells (minutes)
    python benchmarks/memory_plan.py --measure out.json --cells '250M|2|bfloat16'   # one cell
    python benchmarks/memory_plan.py --compare out.json             # predicted vs measured table
    python benchmarks/memory_plan.py --plan-time recipes/arith-tiny-fsdp.yaml   # `unirl plan`'s cost

``--plan-time`` runs ``unirl plan RECIPE`` in fresh interpreters, interleaved with two baselines in the same
run: a bare ``python -c pass`` and ``python -c "import torch"`` (what the plan imported through the actor
classes' modules until the actors registered light declarations); it prints the median wall and CPU
seconds of each and the plan's ratio to them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20

#: model.build of each size (vocab: the demo tokenizer's 259 tokens)
SIZES: dict[str, dict] = {
    "tiny": {},
    "25M": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64),
    "100M": dict(hidden_size=768, intermediate_size=2304, num_hidden_layers=14, num_attention_heads=12,
                 num_key_value_heads=4, head_dim=64),
    # the third size: the largest whose 4-rank cell (~3 GB a rank) fits beside 7 other jobs on a 24 GB host
    "250M": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=20, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=64),
}

#: (size, actor layout: "embedded" or FSDP ranks, compute dtype)
CELLS = [(size, layout, dtype) for size in ("25M", "100M", "250M") for dtype in ("float32", "bfloat16")
         for layout in ("embedded", 1, 2, 4)]


def recipe_args(size: str, layout: str | int, dtype: str) -> tuple[str, list[str]]:
    """The recipe and overrides of one cell."""
    build = json.dumps(SIZES[size]).replace('"', "")
    common = ["sft.steps=0", "trainer.steps=2", "trainer.prompts_per_step=4", "rollout.n=2",
              "rollout.max_new_tokens=8", "trainer.eval_every=0", "trainer.eval_k=1", "actor.micro_batch_size=8",
              "algorithm.updates_per_batch=1", "trainer.progress=false", "trainer.plot=false",
              "data.arith.n_train=64", "data.arith.n_eval=1", f"model.build={build}"]
    if layout == "embedded":
        return str(ROOT / "recipes" / "arith-tiny.yaml"), common + [f"actor.options.compute_dtype={dtype}"]
    cpus = 2 / int(layout)
    opts = (f"actor.options={{world_size: {layout}, cpus_per_rank: {cpus:g}, threads_per_rank: 1, "
            f"compute_dtype: {dtype}, step_timeout_s: 3000, init_timeout_s: 3000}}")
    return str(ROOT / "recipes" / "arith-tiny-fsdp.yaml"), common + [opts]


def measure_cell(size: str, layout: str | int, dtype: str, out: Path) -> float:
    """The largest phase peak (MiB) of the process the actor's state lives in: the trainer (embedded) or
    the largest rank (FSDP)."""
    recipe, extra = recipe_args(size, layout, dtype)
    run = out / f"{size}-{layout}-{dtype}"
    cmd = [sys.executable, "-m", "unirl.cli", "train", recipe, *extra, f"run.output_dir={run}", "run.name=m"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600, env=dict(os.environ))
    if proc.returncode != 0:
        raise SystemExit(f"{size} {layout} {dtype}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
    doc = json.loads((run / "m" / "memory.json").read_text())
    if layout == "embedded":
        return max(p["trainer_rss_mb"] for p in doc["phases"].values())
    return max(max(p["ranks_rss_mb"]) for p in doc["phases"].values() if p["ranks_rss_mb"])


def _cell(text: str) -> tuple[str, str | int, str]:
    """``SIZE|LAYOUT|DTYPE`` (``100M|4|bfloat16``, ``250M|embedded|float32``) as a cell."""
    size, layout, dtype = text.split("|")
    return size, layout if layout == "embedded" else int(layout), dtype


def measure(path: Path, cells: list[tuple[str, str | int, str]] | None = None) -> None:
    results = json.loads(path.read_text()) if path.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for size, layout, dtype in cells or CELLS:
            for s in ("tiny", size):
                key = f"{s}|{layout}|{dtype}"
                if key in results:
                    continue
                results[key] = measure_cell(s, layout, dtype, Path(tmp))
                path.write_text(json.dumps(results, indent=1) + "\n")
                print(key, round(results[key], 1), flush=True)


def predicted_mb(size: str, layout: str | int, dtype: str) -> float:
    """The plan's peak for the device the actor's state lives on, minus the tiny model's (same baseline)."""
    from unirl.memory_plan import plan_recipe

    def peak(s: str) -> float:
        recipe, extra = recipe_args(s, layout, dtype)
        plan = plan_recipe(recipe, extra)
        return max(d.total for d in plan.devices) / MB

    return peak(size) - peak("tiny")


def compare(path: Path) -> list[str]:
    results = json.loads(path.read_text())
    rows = ["| model | actor | compute | predicted MiB | measured MiB (peak - baseline) | error |",
            "|---|---|---|---|---|---|"]
    for size, layout, dtype in CELLS:
        key, base = f"{size}|{layout}|{dtype}", f"tiny|{layout}|{dtype}"
        if key not in results or base not in results:
            continue
        meas = results[key] - results[base]
        pred = predicted_mb(size, layout, dtype)
        actor = "embedded" if layout == "embedded" else f"FSDP x{layout}"
        rows.append(f"| {size} | {actor} | {dtype} | {pred:.0f} | {meas:.0f} ({results[key]:.0f} - {results[base]:.0f}) "
                    f"| {100 * (pred - meas) / meas:+.0f} % |")
    return rows


def _timed(cmd: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one fresh interpreter running ``cmd`` (CPU: user + sys of the child)."""
    import resource
    import time

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def plan_time(recipe: str, reps: int = 5) -> list[str]:
    """``unirl plan`` against python's start and ``import torch``, interleaved, medians."""
    import statistics

    arms = {"python -c pass": [sys.executable, "-c", "pass"],
            "import torch": [sys.executable, "-c", "import torch"],
            "unirl plan": [sys.executable, "-m", "unirl.cli", "plan", recipe]}
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in arms}
    for _ in range(reps):
        for name, cmd in arms.items():
            got[name].append(_timed(cmd))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in got.items()}
    rows = [f"{k:16} wall {w:.2f} s  CPU {c:.2f} s" for k, (w, c) in med.items()]
    plan_w, plan_c = med["unirl plan"]
    rows.append(f"unirl plan / import torch: wall {plan_w / med['import torch'][0]:.2f}x, "
                f"CPU {plan_c / med['import torch'][1]:.2f}x (load average {os.getloadavg()[0]:.1f})")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure", type=Path)
    ap.add_argument("--compare", type=Path)
    ap.add_argument("--plan-time", metavar="RECIPE")
    ap.add_argument("--cells", type=_cell, nargs="+", metavar="SIZE|LAYOUT|DTYPE",
                    help="measure only these cells (default: all), e.g. 100M|4|bfloat16")
    args = ap.parse_args(argv)
    if args.plan_time:
        print("\n".join(plan_time(args.plan_time)))
    if args.measure:
        measure(args.measure, args.cells)
    if args.compare:
        print("\n".join(compare(args.compare)))


if __name__ == "__main__":
    main()
