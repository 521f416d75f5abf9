"""Stop a run whose samples keep failing, instead of training on nothing while the bar shows reward 0.

A failed sample (a reward that raised, an engine error) has reward NaN and no part in the loss, so a
run where every reward fails looks exactly like a model that is always wrong. ``trainer.max_failed_frac``
(default 0.5) for ``trainer.max_failed_steps`` consecutive steps (default 3) is where that stops being
noise: the run ends with a message naming the reward and one of the errors.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

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

    def check_or_stop(self, step: int, metrics: dict[str, Any], run: Any, *, on_stop: Callable[[], None]) -> None:
        """:meth:`check` on the step's ``failed_frac``, quoting the run's ``failure_example`` (the
        latest failed training sample's error); when the run must stop: ``on_stop()`` (flush what the run
        has so far), then raise."""
        stop = self.check(step, metrics["failed_frac"], run.failure_example)
        if stop is not None:
            on_stop()
            raise stop


class NonFiniteError(UniRLError):
    """Updates with a NaN / Inf loss or gradient for ``algorithm.nonfinite_patience`` steps in a row."""


class NonFiniteGuard:
    """``algorithm.nonfinite``: the actor always drops an update whose loss or gradient is not finite
    (weights and optimizer untouched) and counts it (``nonfinite_updates``). ``abort`` stops the run
    after ``nonfinite_patience`` such steps in a row, naming the step, what was non-finite and the
    batch's samples, with a debug bundle (the batch, its seeds, the weight version) to reproduce it;
    ``skip`` goes on."""

    def __init__(self, config: RunConfig, run_dir: Path) -> None:
        self.config, self.run_dir = config, run_dir
        self.streak = 0

    def check_or_stop(self, step: int, metrics: dict[str, Any], run: Any, *, on_stop: Callable[[], None]) -> None:
        """Count the step's dropped updates; after ``nonfinite_patience`` in a row (``abort``): the debug
        bundle of the run's ``last_batch``, ``on_stop()``, then raise."""
        a = self.config.algorithm
        dropped = metrics.get("nonfinite_updates", 0)
        self.streak = self.streak + 1 if dropped else 0
        if not dropped or a.nonfinite == "skip" or self.streak < a.nonfinite_patience:
            return
        bundle = self._bundle(step, metrics, run)
        on_stop()
        where = metrics.get("nonfinite_first") or "the loss or the gradient"
        samples = metrics.get("nonfinite_samples", [])
        raise NonFiniteError(
            f"stopped after step {step}: {dropped} update(s) had a non-finite {where} (loss {metrics.get('loss')}, "
            f"grad_norm {metrics.get('grad_norm')}) for {self.streak} step(s) in a row "
            f"(algorithm.nonfinite_patience={a.nonfinite_patience}); samples {', '.join(samples[:8])}"
            f"{' ...' if len(samples) > 8 else ''}; debug bundle: {bundle} (the batch, its seeds, the weight "
            "version). Fix: lower actor.lr or set actor.grad_clip, check the reward's scale, or set "
            "algorithm.nonfinite=skip to drop such updates and go on")

    def _bundle(self, step: int, metrics: dict[str, Any], run: Any) -> Path:
        """``RUN_DIR/debug/nonfinite-step_N.pt``: what reproduces the failing update."""
        import torch

        out = self.run_dir / "debug" / f"nonfinite-step_{step:06d}.pt"
        out.parent.mkdir(parents=True, exist_ok=True)
        batch, engine = run.last_batch, run.c.engine
        torch.save({"step": step, "metrics": metrics, "version": engine.weight_version if engine else None,
                    "run_seed": self.config.run.seed,
                    "samples": [{"id": s.id, "seed": s.seed, "prompt_ids": s.prompt_ids, "response_ids": s.response_ids,
                                 "loss_mask": s.loss_mask, "rollout_logprobs": s.rollout_logprobs, "reward": s.reward,
                                 "versions": s.versions} for s in batch]}, out)
        return out
