"""What every scored rollout owes the rest of the run: the ``unirl_on_rollout`` hook and the trace.

Why here and not in a controller: it is the same for training and evaluation and for every controller
(a controller generates, validates and scores; the trainer tells the plugins), so it is written once.
"""

from __future__ import annotations

import math
from typing import Any

from unirl.config import RunConfig
from unirl.kernel.manager import Kernel
from unirl.samples import Sample


def observe_rollout(c: Any, samples: list[Sample], config: RunConfig, kernel: Kernel, *, phase: str,
                    step: int, version: int) -> None:
    """Tell the plugins and the tracer about scored samples (the controller scored them)."""
    kernel.call("unirl_on_rollout", phase=phase, step=step, version=version, samples=samples, config=config)
    c.tracer.record(phase=phase, step=step, version=version, samples=samples)


def first_error(samples: list[Sample]) -> str | None:
    """The error of the first failed sample (None: none failed): what ``trainer.max_failed_frac``'s stop
    message quotes, carried by the batch to the run (:class:`unirl.trainer.step.ScoredBatch`)."""
    return next((s.meta.get("error") for s in samples if s.failed), None)


def mean_reward(samples: list[Sample]) -> float:
    """Mean over the samples that were scored; failed ones (NaN) are not misses and do not count."""
    rewards = [s.reward for s in samples if not math.isnan(s.reward)]
    return sum(rewards) / max(len(rewards), 1)
