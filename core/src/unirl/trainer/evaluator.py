"""Held-out evaluation during training: when it runs, and what it measures.

Why a component: the loop asks ``should_eval(step)`` and ``run(step)``; the interval policy
(``trainer.eval_every``, and always after the last step) lives here, as the checkpointer owns its own.
Every eval draws under :func:`unirl.samples.eval_seed`, so evals at different steps (and ``unirl eval``)
compare like with like.
"""

from __future__ import annotations

import math
from typing import Any

from unirl.config import RunConfig
from unirl.contracts import SamplingParams
from unirl.kernel.manager import Kernel
from unirl.rollout.stall import watched
from unirl.samples import Sample
from unirl.trainer.report import say
from unirl.trainer.rollouts import mean_reward, observe_rollout


def evaluate(c: Any, prompts: list[Sample], config: RunConfig, stops: list[int], kernel: Kernel,
             step: int, *, tag: str | None = None) -> list[Sample]:
    """k scored samples per held-out prompt through the recipe's eval controller (an agentic one
    multi-turn, with its tools), under the same seeds every time (its base seed is :func:`eval_seed`)."""
    k = config.trainer.eval_k
    sampling = SamplingParams.from_config(config, stops, temperature=config.trainer.eval_temperature)
    queue = [p.copy() for p in prompts]
    version = c.engine.weight_version

    def draw(n: int) -> list[Sample]:
        out, queue[:] = queue[:n], queue[n:]
        return out

    launch = tag or f"eval-{step}"
    # under rollout.stall_timeout_s like every train collect: a hung engine fails the eval fast, restartable
    slots = watched(lambda: c.eval_controller.collect(draw, groups=len(prompts), n=k, sampling=sampling,
                                                      launch_tag=launch),
                    engine=c.engine, engine_name=config.rollout.engine, timeout_s=config.rollout.stall_timeout_s,
                    launch=launch)
    observe_rollout(c, slots, config, kernel, phase="eval", step=step, version=version)
    return slots


def eval_score(slots: list[Sample], config: RunConfig, step: int) -> float:
    """:func:`mean_reward` of an eval, saying how many samples failed (they are not misses), and NaN when
    none was scored: an eval whose every reward failed must not read as a model scoring 0."""
    failed = [s for s in slots if s.failed]
    if failed:
        example = next((s.meta.get("error") for s in failed if s.meta.get("error")), "no error recorded")
        say(config, f"eval at step {step}: {len(failed)} of {len(slots)} samples failed (e.g. {example}); "
            f"avg@{config.trainer.eval_k} counts only the {len(slots) - len(failed)} scored ones")
    if len(failed) == len(slots) and slots:
        return math.nan
    return mean_reward(slots)


class Evaluator:
    """avg@k on the held-out prompts: mean reward over ``trainer.eval_k`` samples per prompt."""

    def __init__(self, c: Any, prompts: list[Sample], config: RunConfig, stops: list[int], kernel: Kernel) -> None:
        self.c, self.prompts, self.config, self.stops, self.kernel = c, prompts, config, stops, kernel

    def should_eval(self, done: int) -> bool:
        """After every ``trainer.eval_every`` steps, and after the last step."""
        t = self.config.trainer
        return bool(t.eval_every and done % t.eval_every == 0) or done == t.steps

    def run(self, step: int) -> dict[str, float]:
        """``eval`` (avg@k), the weight version it measured (``eval/weight_version``), and the eval
        controller's metrics of this eval (``eval_*``, e.g. mean turns)."""
        version = self.c.engine.weight_version
        slots = evaluate(self.c, self.prompts, self.config, self.stops, self.kernel, step)
        out = {"eval": eval_score(slots, self.config, step), "eval/weight_version": version}
        out.update({f"eval_{k}": v for k, v in self.c.eval_controller.metrics().items()})
        return out
