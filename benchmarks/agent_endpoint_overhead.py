"""Step time of a drive through the OpenAI-compatible endpoint (``rollout.controller: openai_agent``) against the
same task through ``tool_env``'s controller (``rollout.controller: agentic``), in the same run.

Both sides drive the same embedded TorchEngine (tiny random Qwen3, byte-level demo tokenizer) through
``--groups`` x ``--n`` trajectories of exactly ``--turns`` model turns of ``--tokens`` tokens each
(``ignore_eos``), with the same observation after every turn (``<tool_response>42</tool_response>``), so
the engine does the same work and the difference is the controller: HTTP + JSON + the openai client +
template rendering of each delta against an in-process environment step. The sides are interleaved
(``--repeats`` rounds); the median collect seconds of each and their ratio are printed.

``--train``: the issue's target (<= 1.3x) is a **step** time, so each round also trains on what it
collected, as the demo recipe's step does (``recipes/agentic-calc-openai-tiny.yaml``: its actor and loss;
the pi_old replay, then one update over the batch), with the engine serving the actor's own model (the
in-process sync). The train phase does the same work on both sides (same token counts); the step ratio
and the collect ratio are printed apart.

    .venv/bin/python benchmarks/agent_endpoint_overhead.py --groups 8 --n 8 --turns 3 --tokens 16 --train
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "agentic-calc-openai-tiny.yaml"


def make_env(turns: int):
    from unirl.api import Environment, EnvStep

    class FixedTurns(Environment):
        """Answers every model turn with one tool result; done after ``turns`` model turns."""

        stateful = False
        stop = ()

        def reset(self, sample):
            pass

        def step(self, sample, turn_text):
            if sample.turns >= turns:
                return EnvStep(done=True, reward=0.0)
            return EnvStep(observation="\n<tool_response>42</tool_response>\n")

        def close(self, sample):
            pass

    return FixedTurns()


def make_agent(turns: int):
    async def agent(client, task):
        messages = [{"role": "user", "content": task["prompt"]}]
        for k in range(turns):
            r = await client.chat.completions.create(model="unirl-policy", messages=messages)
            if k + 1 < turns:
                messages += [r.choices[0].message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": "c", "content": "42"}]
        return 0.0
    return agent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train", action="store_true", help="time whole steps: collect, then the demo's train phase")
    a = ap.parse_args()

    from unirl_agentic.controller import AgenticRolloutController
    from unirl_agentic.openai_controller import OpenAIAgentController

    from unirl.api import Qwen3Adapter, RunConfig, Sample, SamplingParams, build_demo_tokenizer, build_engine

    actor = trainer(a) if a.train else None
    tok = actor.tokenizer if actor is not None else build_demo_tokenizer()
    engine = build_engine(RunConfig(), adapter=Qwen3Adapter(), tokenizer=tok,
                          **({"model": actor.model} if actor is not None else {}))
    sampling = SamplingParams(max_new_tokens=a.tokens, ignore_eos=True, max_response_tokens=4096)
    counter = [0]

    def draw(k):
        out = []
        for _ in range(k):
            counter[0] += 1
            text = f"Q: {counter[0] % 10}*{counter[0] % 7}=? A:"
            out.append(Sample(id=f"p{counter[0]}", prompt_ids=tok.encode(text, add_special_tokens=False),
                              prompt_text=text, answer=0))
        return out

    env_ctl = AgenticRolloutController(engine, make_env(a.turns), tok, lambda text, s: 0.0, base_seed=0)
    api_ctl = OpenAIAgentController(engine, tok, make_agent(a.turns), base_seed=0, concurrency=a.groups * a.n)
    sides = {"tool_env": env_ctl, "openai_agent": api_ctl}
    times: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in sides}  # the process's CPU seconds: less load-bound than wall
    steps: dict[str, list[float]] = {k: [] for k in sides}  # --train: collect + train, wall and CPU
    step_cpu: dict[str, list[float]] = {k: [] for k in sides}
    tokens: dict[str, int] = {}
    try:
        for ctl in sides.values():  # warm-up (server start, first forward)
            ctl.collect(draw, groups=1, n=2, sampling=sampling)
        for _ in range(a.repeats):
            for name, ctl in sides.items():
                t0, c0 = time.perf_counter(), time.process_time()
                out = ctl.collect(draw, groups=a.groups, n=a.n, sampling=sampling)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                tokens[name] = sum(sum(s.loss_mask) for s in out)
                assert all(s.turns == a.turns and not s.failed for s in out), name
                if actor is not None:
                    train_phase(actor, out)
                    steps[name].append(time.perf_counter() - t0)
                    step_cpu[name].append(time.process_time() - c0)
    finally:
        env_ctl.close()
        api_ctl.close()
        engine.close()
        if actor is not None:
            actor.close()
    shape = f"{a.groups}x{a.n} trajectories, {a.turns} turns of {a.tokens} tokens"
    report("collect", times, cpu, tokens, shape)
    if actor is not None:
        report("step", steps, step_cpu, tokens, shape + ", collect + train")


def trainer(a: argparse.Namespace):
    """The demo recipe's actor (model, tokenizer, optimizer, loss), built as a run builds it."""
    from unirl.api import Qwen3Adapter, build_actor, load_config

    config = load_config(RECIPE, ["sft.steps=0", f"rollout.max_new_tokens={a.tokens}"])
    return build_actor(config, adapter=Qwen3Adapter())


def train_phase(actor, samples) -> None:
    """The demo's train half on ``samples``: the pi_old replay (``old_logp_source: replay``), then one
    update (``micro_batch_size: 64``, one mini-batch), with a fixed advantage per trajectory (the work does
    not depend on its value)."""
    import torch

    old = actor.logprobs(samples)
    adv = [torch.full((len(s.response_ids),), 1.0 if k % 2 else -1.0) for k, s in enumerate(samples)]
    actor.train_step(samples, {"advantages": adv, "old_logprobs": old})


def report(what: str, times: dict[str, list[float]], cpu: dict[str, list[float]], tokens: dict[str, int],
           shape: str) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    mcpu = {k: statistics.median(v) for k, v in cpu.items()}
    for k in times:
        print(f"{k:>13}: {med[k]:.2f} s per {what} (median of {len(times[k])}: "
              f"{', '.join(f'{x:.2f}' for x in times[k])}), CPU {mcpu[k]:.2f} s, {tokens[k]} model tokens")
    print(f"{what} ratio openai_agent / tool_env: {med['openai_agent'] / med['tool_env']:.2f}x wall, "
          f"{mcpu['openai_agent'] / mcpu['tool_env']:.2f}x CPU ({shape}); load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
