"""Reward ``weighted``: a weighted sum of named rewards (``reward.terms: {exact_int: 0.2, judge: 1.0}``).

Why a sum of registered names rather than a formula: each term is a reward the registry already has (a
rule for the format, a judge for the content), built and preflighted like a reward of its own, and
each term's value is kept in ``sample.meta["reward_terms"]`` so the trainer logs ``reward/<name>`` for
every term beside the total. A term that fails a sample (NaN) fails the sum for that sample: a
partial sum would silently score a different objective.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

from unirl.contracts import BatchReward
from unirl.kernel.errors import PluginError, Violation
from unirl.rewards.build import CORE, build_reward, close_reward, reward_factory, reward_values

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import RunConfig
    from unirl.samples import Sample


class WeightedSum(BatchReward):
    """``sum(weight * term)`` over ``reward.terms``; every term scores the whole batch in one call."""

    reads: ClassVar[tuple[str, ...]] = ("terms",)

    @classmethod
    def check(cls, config: RunConfig, kernel: Any) -> list[Violation]:
        terms = config.reward.terms
        if not terms:
            return [Violation(CORE, "reward.terms", "reward 'weighted' needs at least one term",
                              "set reward.terms, e.g. {exact_int: 0.2, judge: 1.0}")]
        out: list[Violation] = []
        for name, weight in terms.items():
            where = f"reward.terms.{name}"
            if not math.isfinite(weight):
                out.append(Violation(CORE, where, f"weight {weight} is not finite", "give a finite weight"))
            try:
                factory = reward_factory(kernel, name)
            except PluginError as exc:
                out.append(Violation(CORE, where, str(exc), "name a registered reward (unirl plugins lists them)"))
                continue
            if isinstance(factory, type) and issubclass(factory, WeightedSum):
                out.append(Violation(CORE, where, "a weighted term cannot itself be 'weighted'",
                                     "list its terms here directly"))
            elif isinstance(factory, type):
                out += factory.check(config, kernel)
        return out

    def __init__(self, *, config: RunConfig, kernel: Any) -> None:
        self.weights = dict(config.reward.terms)
        self.terms: dict[str, Any] = {}
        try:
            for name in self.weights:
                self.terms[name] = build_reward(config, kernel, name)
        except BaseException:
            self.close()
            raise

    def score_batch(self, completions: list[str], samples: list[Sample]) -> list[float]:
        per_term = {name: reward_values(term, completions, samples) for name, term in self.terms.items()}
        out = []
        for i, s in enumerate(samples):
            parts = {name: values[i] for name, values in per_term.items()}
            s.meta["reward_terms"] = parts
            bad = [name for name, v in parts.items() if not math.isfinite(v)]
            if bad:
                s.meta["reward_error"] = (f"reward term '{bad[0]}' failed: "
                                          f"{s.meta.get('reward_error', f'it returned {parts[bad[0]]}')}")
                out.append(math.nan)
            else:
                out.append(sum(self.weights[name] * v for name, v in parts.items()))
        return out

    def close(self) -> None:
        for term in self.terms.values():
            close_reward(term)
