"""The ``agentic-calc-tiny`` demo: a tiny Qwen3 learns to multiply multi-digit numbers *with* the
calculator (``unirl agentic-demo recipes/agentic-calc-tiny.yaml``).

Why this task: the products of held-out digit pairs were never seen, so unaided the model can only
guess, while through the tool they are exact: accuracy measures tool use. The steps:

1. **SFT warm start** on synthetic tool-use traces (:func:`tool_trace`): the model turn is the call, the
   tool turn (loss mask 0) is the calculator's real output, the last model turn copies the result.
   Deliberately partial (``plugins.agentic.warm_start_tool_share: 0.5`` in the recipe: the trainer's
   warm start answers the other half unaided), so RL has a choice to learn: call the tool.
2. **GRPO with the calculator**: ``unirl train`` on the same recipe runs SFT + GRPO with this
   controller as the trainer's rollout (``rollout.controller: agentic``, see docs/agentic.md);
   ``run_demo(..., rl=...)`` takes an RL phase as a callable, so this driver never copies the step.
3. Held-out accuracy and mean turns **before and after**, through the same controller.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from typing import Any

from unirl.api import (
    RunConfig,
    Sample,
    SamplingParams,
    build_runtime,
    eval_seed,
    load_kernel,
    load_prompts,
)
from unirl_agentic.controller import AgenticRolloutController
from unirl_agentic.options import agentic_options
from unirl_agentic.traces import expression_of, tool_trace

__all__ = ["evaluate", "expression_of", "main", "run_demo", "tool_trace"]


def evaluate(controller: AgenticRolloutController, prompts: list[Sample], k: int,
             sampling: SamplingParams) -> dict[str, float]:
    """Held-out accuracy (mean reward; failed trajectories excluded) and mean model turns."""
    queue = list(prompts)

    def draw(n: int) -> list[Sample]:
        out, queue[:] = queue[:n], queue[n:]
        return out

    out = controller.collect(draw, groups=len(prompts), n=k, sampling=sampling)
    scored = [s for s in out if not s.failed]
    return {"accuracy": sum(s.reward for s in scored) / max(len(scored), 1),
            "mean_turns": sum(s.turns for s in out) / max(len(out), 1),
            "tool_calls": sum(s.meta.get("tool_calls", 0) for s in out) / max(len(out), 1),
            "failed": float(len(out) - len(scored))}


RLPhase = Callable[..., None]


def run_demo(config: RunConfig, *, rl: RLPhase | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """SFT warm start, eval, the ``rl`` phase (when given), eval. Returns the report."""
    kernel = load_kernel()
    adapter = kernel.build("model_adapters", config.model.adapter)
    tok = adapter.build_tokenizer(config)
    # tools and the environment first: they are cheap, and one the host cannot provide (a sandbox account
    # that does not exist) then fails before any model is built
    tools = {name: kernel.build("tools", name, config=config) for name in config.rollout.tools}
    env = kernel.build("environments", config.rollout.environment, config=config, tools=tools, tokenizer=tok)
    runtime = build_runtime(config, kernel, adapter=adapter)
    parts = dict(config=config, adapter=adapter, tokenizer=tok, runtime=runtime)
    actor = kernel.build("actors", config.actor.name, options=config.actor.options, options_at="actor.options",
                         **parts)
    engine = kernel.build("rollout_engines", config.rollout.engine, options=config.rollout.options,
                          options_at="rollout.options", **parts)
    sync = kernel.build("weight_syncs", config.weight_sync.name, options=config.weight_sync.options,
                        options_at="weight_sync.options", config=config)
    reward = kernel.get("rewards", config.reward.name).load()
    opts = agentic_options(config)
    controller = AgenticRolloutController(engine, env, tok, reward, opts, tag="eval",
                                          base_seed=eval_seed(config.run.seed), repeat_seeds=True)
    report: dict[str, Any] = {}
    try:
        train, _ = load_prompts(config, tok, "train")
        held, _ = load_prompts(config, tok, "eval")
        rng = random.Random(config.run.seed)
        for step in range(config.sft.steps):
            # the trainer's warm-start traces (plugins.agentic.warm_start, warm_start_tool_share)
            batch = controller.warm_start_samples(rng.sample(train, config.sft.batch_size))
            m = actor.sft_step(batch)
            if step % 25 == 0 or step == config.sft.steps - 1:
                log(f"sft {step + 1}/{config.sft.steps} loss {m['sft_loss']:.4f}")
        receipts, manifest = sync.publish(actor, engine, engine.weight_version + 1)
        sampling = SamplingParams.from_config(config, [tok.eos_token_id],
                                              temperature=config.trainer.eval_temperature)
        report["before"] = evaluate(controller, held, config.trainer.eval_k, sampling)
        log(f"warm start: {json.dumps(report['before'])}")
        if rl is not None:
            rl(config=config, kernel=kernel, actor=actor, engine=engine, sync=sync, env=env, tokenizer=tok,
               prompts=train)
            report["after"] = evaluate(controller, held, config.trainer.eval_k, sampling)
            log(f"after GRPO: {json.dumps(report['after'])}")
            report["gain"] = report["after"]["accuracy"] - report["before"]["accuracy"]
    finally:
        controller.close()
        engine.close()
        actor.close()
    return report


def main(argv: list[str]) -> int:
    """``unirl agentic-demo RECIPE [key=value ...]``: SFT warm start and eval (SFT + GRPO: ``unirl train``
    with the same recipe)."""
    from unirl.api import load_config

    if not argv:
        print("usage: unirl agentic-demo RECIPE [key.sub=value ...]", file=sys.stderr)
        return 2
    config = load_config(argv[0], argv[1:])
    run_demo(config)
    return 0
