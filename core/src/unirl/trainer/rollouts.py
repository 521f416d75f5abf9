"""Scored rollouts as the trainer sees them: generate, validate, score, and tell the plugins.

Why here and not in a controller: what every rollout owes the rest of the run (validation of what the
engine returned, the ``unirl_on_rollout`` hook, the trace) is the same for training and evaluation, for
the batch path and for a controller's collect, so it is written once.
"""

from __future__ import annotations

import math
from typing import Any

from unirl.config import RunConfig
from unirl.contracts import SamplingParams
from unirl.kernel.manager import Kernel
from unirl.rewards.builtin import score
from unirl.samples import Sample


def rollout(c: Any, samples: list[Sample], sampling: SamplingParams, config: RunConfig,
            kernel: Kernel, *, phase: str, step: int) -> dict[str, int]:
    """Generate, validate every sample the engine returned, score, and tell the plugins."""
    version = c.engine.weight_version
    c.engine.generate(samples, sampling)
    return score_rollout(c, samples, config, kernel, phase=phase, step=step, version=version)


def score_rollout(c: Any, samples: list[Sample], config: RunConfig, kernel: Kernel, *, phase: str,
                  step: int, version: int) -> dict[str, int]:
    """Validate what the engine returned, score it, and tell the plugins (sync rollouts and async reaps)."""
    for s in samples:
        s.validate(source=f"rollout engine '{config.rollout.engine}'")
    stats = score(samples, c.reward_fn)
    observe_rollout(c, samples, config, kernel, phase=phase, step=step, version=version)
    return stats


def observe_rollout(c: Any, samples: list[Sample], config: RunConfig, kernel: Kernel, *, phase: str,
                    step: int, version: int) -> None:
    """Tell the plugins and the tracer about scored samples (a controller's are scored by it)."""
    if phase == "train":
        c.failure_example = next((s.meta.get("error") for s in samples if s.failed), c.failure_example)
    kernel.call("unirl_on_rollout", phase=phase, step=step, version=version, samples=samples, config=config)
    if c.tracer is not None:
        c.tracer.record(phase=phase, step=step, version=version, samples=samples)


def mean_reward(samples: list[Sample]) -> float:
    """Mean over the samples that were scored; failed ones (NaN) are not misses and do not count."""
    rewards = [s.reward for s in samples if not math.isnan(s.reward)]
    return sum(rewards) / max(len(rewards), 1)
