"""The numerics alarm: a step whose numerics term is above ``diagnostics.mismatch_threshold`` (k3 KL).

Why a table: the causes of an engine-vs-trainer gap that can be read from the config before anything
runs (the same facts preflight reads) are a short list, each a predicate and a sentence. A new cause
is a new row, not another branch. The alarm fires once a run (``warn``: a :class:`MismatchWarning`;
``error``: a :class:`MismatchAlarmError` that stops the run), naming every row that applies and the
packaged parity profile that removes kernel differences for this engine, dtype and model (found by
reading the profiles' own ``plugins.parity`` sections, docs/parity.md). docs/mismatch.md has the table.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from unirl.kernel.errors import UniRLError

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import RunConfig

#: sampling settings an engine may take in its options that no replay applies, with their "off" value
ENGINE_ONLY_SAMPLING = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}


class MismatchWarning(UserWarning):
    """The numerics term of the train-inference mismatch is above the alarm's threshold."""


class MismatchAlarmError(UniRLError, RuntimeError):
    """``diagnostics.mismatch_alarm: error`` and the numerics term crossed the threshold."""


def engine_dtype(config: RunConfig) -> str:
    """The dtype the engine serves in: its options' ``dtype`` (or ``engine_args.dtype``), else ``model.dtype``."""
    opts = config.rollout.options
    return str(opts.get("dtype") or (opts.get("engine_args") or {}).get("dtype") or config.model.dtype)


def trainer_dtype(config: RunConfig) -> str:
    """The dtype the trainer's forward computes in: ``actor.options.compute_dtype``, else fp32 (master weights)."""
    return str(config.actor.options.get("compute_dtype") or "float32")


def _engine_sampling(config: RunConfig) -> dict[str, Any]:
    opts = config.rollout.options
    merged = {**(opts.get("engine_args") or {}), **opts}
    return {k: merged[k] for k, off in ENGINE_ONLY_SAMPLING.items() if k in merged and merged[k] != off}


def _logprobs_mode_disagrees(config: RunConfig) -> bool:
    mode = config.rollout.options.get("logprobs_mode")
    return mode is not None and not str(mode).startswith(config.rollout.logprobs)


def _raw_but_processed(config: RunConfig) -> bool:
    r = config.rollout
    return r.logprobs == "raw" and (r.temperature != 1.0 or r.top_k > 0 or r.top_p < 1.0)


@dataclass(frozen=True)
class Cause:
    """One likely cause: the settings it names, when it applies, and what it says (``{...}`` from the config)."""

    setting: str
    applies: Callable[[RunConfig], bool]
    says: Callable[[RunConfig], str]


#: the causes the alarm can name, in the order it names them (docs/mismatch.md lists the same rows)
CAUSES: tuple[Cause, ...] = (
    Cause("rollout.options.dtype / model.dtype vs actor.options.compute_dtype",
          lambda c: engine_dtype(c) != trainer_dtype(c),
          lambda c: f"the engine serves {engine_dtype(c)} weights, the trainer computes in {trainer_dtype(c)}"),
    Cause("rollout.options.logprobs_mode vs rollout.logprobs", _logprobs_mode_disagrees,
          lambda c: f"the engine reports {c.rollout.options.get('logprobs_mode')}, the replay computes "
                    f"rollout.logprobs: {c.rollout.logprobs}"),
    Cause("rollout.logprobs with temperature / top_k / top_p", _raw_but_processed,
          lambda c: "the engine samples after temperature / top-k / top-p, the log-probs are raw on both sides "
                    "(rollout.logprobs: processed takes them where the tokens were drawn)"),
    Cause("rollout.options (engine-only sampling)", lambda c: bool(_engine_sampling(c)),
          lambda c: f"the engine applies {_engine_sampling(c)}, which no replay applies"),
    Cause("actor.options.compile", lambda c: bool(c.actor.options.get("compile")),
          lambda c: "the actor runs compiled kernels, the engine eager ones"),
)


def likely_causes(config: RunConfig) -> list[str]:
    """Each applying row of :data:`CAUSES` as ``"<setting>: <sentence>"``."""
    return [f"{cause.setting}: {cause.says(config)}" for cause in CAUSES if cause.applies(config)]


def parity_profile(config: RunConfig) -> str | None:
    """The packaged parity recipe for this engine, engine dtype and model adapter (read from each profile's
    ``plugins.parity`` section), or None when no profile covers them."""
    from unirl.recipe_files import packaged_recipes, read_recipe

    for name, path in packaged_recipes().items():
        try:
            data = read_recipe(path)
        except Exception:  # noqa: BLE001 - an unreadable recipe is no suggestion
            continue
        parity = (data.get("plugins") or {}).get("parity") or {}
        topology = parity.get("topology") or {}
        if (parity and topology.get("engine") == config.rollout.engine and parity.get("dtype") == engine_dtype(config)
                and (data.get("model") or {}).get("adapter") == config.model.adapter):
            return name
    return None


class MismatchAlarm:
    """Checks each step's numerics k3 against ``diagnostics.mismatch_threshold``; fires once a run."""

    def __init__(self, config: RunConfig, *, parity_on: bool = False) -> None:
        self.config, self.parity_on, self.fired = config, parity_on, False
        d = config.diagnostics
        self.mode, self.threshold = d.mismatch_alarm, d.mismatch_threshold

    def message(self, step: int, k3: float) -> str:
        causes = likely_causes(self.config)
        profile = parity_profile(self.config)
        fix = (f"the parity profile {profile} (UNIRL_PARITY_ENABLE=1 unirl train {profile}; docs/parity.md) makes "
               "this term exactly 0" if profile else "no packaged parity profile covers this engine, dtype and model "
               "(docs/parity.md)")
        if self.parity_on:
            fix = "parity is on, so this term should be 0: report it with the run's parity/artifact.json"
        return (f"train-inference mismatch: the numerics term's k3 KL is {k3:.3g} at step {step + 1}, above "
                f"diagnostics.mismatch_threshold {self.threshold:g} (engine vs trainer on the same weights, "
                f"docs/mismatch.md). Likely causes: {'; '.join(causes) or 'none visible in the config (kernels)'}. "
                f"Fix: {fix}; or set diagnostics.mismatch_alarm: off")

    def check(self, step: int, k3: float) -> bool:
        """Fire (once) when ``k3`` is above the threshold; True when it fired now."""
        if self.mode in ("off", False) or self.fired or not k3 > self.threshold:
            return False
        self.fired = True
        text = self.message(step, k3)
        if self.mode == "error":
            raise MismatchAlarmError(text)
        warnings.warn(text, MismatchWarning, stacklevel=2)
        return True
