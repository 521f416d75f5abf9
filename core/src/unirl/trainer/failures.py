"""Stop a run whose samples keep failing, instead of training on nothing while the bar shows reward 0.

A failed sample (a reward that raised, an engine error) has reward NaN and no part in the loss, so a
run where every reward fails looks exactly like a model that is always wrong. ``trainer.max_failed_frac``
(default 0.5) for ``trainer.max_failed_steps`` consecutive steps (default 3) is where that stops being
noise: the run ends with a message naming the reward and one of the errors.
"""

from __future__ import annotations

from collections.abc import Callable

from unirl.config import RunConfig
from unirl.kernel.errors import UniRLError


class TooManyFailuresError(UniRLError):
    """Most samples failed for ``trainer.max_failed_steps`` steps in a row (exit 2, no traceback)."""


class FailureGuard:
    """Counts consecutive steps whose failed fraction is above ``trainer.max_failed_frac``."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.streak = 0

    def check(self, step: int, failed_frac: float, example: str | None) -> TooManyFailuresError | None:
        """The error to stop with after step ``step`` (1-based), or None to go on."""
        t = self.config.trainer
        self.streak = self.streak + 1 if failed_frac > t.max_failed_frac else 0
        if self.streak < t.max_failed_steps:
            return None
        return TooManyFailuresError(
            f"stopped after step {step}: more than trainer.max_failed_frac={t.max_failed_frac:g} of the samples "
            f"failed in each of the last {self.streak} steps (now {failed_frac:.0%}; "
            f"trainer.max_failed_steps={t.max_failed_steps}). Reward '{self.config.reward.name}', engine "
            f"'{self.config.rollout.engine}'; one error: {example or 'none recorded'}. Fix the reward or the data "
            "(metrics.jsonl has failed_frac per step), or set trainer.max_failed_frac=1 to never stop")

    def check_or_stop(self, step: int, failed_frac: float, example: str | None, *, on_stop: Callable[[], None]) -> None:
        """:meth:`check`, and when the run must stop: ``on_stop()`` (flush what the run has so far), then raise."""
        stop = self.check(step, failed_frac, example)
        if stop is not None:
            on_stop()
            raise stop
