"""When the trainer must replay pi_old, and when the training forward already is pi_old.

The trainer's old-policy replay (``actor.logprobs(samples)``) is a full no-grad forward over the
batch. With one optimizer update per batch, pi_old is the policy the update's own forward runs: the
weights have not moved since the rollout. Then the training forward's detached log-probs *are* pi_old,
bit for bit (:meth:`unirl.contracts.Actor.train_step` without ``old_logprobs``; the actor skeleton's
replay and training forward run the same micro-batches through the same function, and
``core/tests/test_step_speed.py`` checks losses and gradients bitwise), and the replay is a second
forward that changes nothing.

It stops being redundant as soon as something reads pi_old *before* the update, or the update is not
the first since the rollout:

* ``algorithm.updates_per_batch > 1``: later mini-batches must use the batch-start policy;
* ``algorithm.kl_coef > 0`` with ``kl_form: reward``: the KL penalty is folded into the rewards from
  ``old_logprobs`` before the estimator runs;
* any ``algorithm.modifiers`` entry: a loss modifier runs after pi_old is known and may read it
  (rollout correction weights by ``old_logprobs - rollout_logprobs``); modifiers declare nothing
  finer, so any modifier keeps the replay.

With ``old_logp_source: rollout`` there is no replay at all (the engine's log-probs are pi_old) and
this returns False as well. The trainer wires it as::

    if a.old_logp_source == "rollout":
        batch["old_logprobs"] = rollout_logp
    elif old_logprobs_needed(config, runtime, modifiers):
        batch["old_logprobs"] = actor.logprobs(samples)
    # else: absent; each micro-batch's forward supplies pi_old

What the skipped replay also fed: the ``rollout_replay_max_diff`` metric (engine vs trainer
numerics) needs the trainer's log-probs, which the before-backward hook sees per micro-batch anyway.

``runtime`` is accepted so a future runtime fact (e.g. a parity provider whose numerics differ
between the "replay" and "train" phases) can veto the shortcut here; core's own providers run both
phases on the same ops, so today it vetoes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import RunConfig
    from unirl.runtime import Runtime


def replay_reasons(config: RunConfig, modifiers: Sequence[Any] = ()) -> list[str]:
    """Why the separate pi_old replay is needed under ``config`` (empty: it is redundant), each reason
    naming the setting that causes it (for logs and errors)."""
    a = config.algorithm
    if a.old_logp_source != "replay":
        return []
    reasons = []
    if a.updates_per_batch > 1:
        reasons.append(f"algorithm.updates_per_batch={a.updates_per_batch}: later mini-batches use the "
                       "batch-start policy")
    if a.kl_coef > 0 and a.kl_form == "reward":
        reasons.append("algorithm.kl_form=reward: the KL penalty reads pi_old before the estimator")
    mods = list(modifiers) or list(a.modifiers)
    if mods:
        names = ", ".join(getattr(m, "__name__", str(m)) for m in mods)
        reasons.append(f"algorithm.modifiers ({names}): a loss modifier may read old_logprobs")
    return reasons


def old_logprobs_needed(config: RunConfig, runtime: Runtime | None = None, modifiers: Sequence[Any] = ()) -> bool:
    """Whether the trainer must run ``actor.logprobs`` (the pi_old replay) before training.

    False when ``old_logp_source`` is ``rollout`` (no replay) or when the training forward's own
    log-probs are pi_old (see the module doc); ``modifiers`` are the loaded loss modifiers (or
    ``config.algorithm.modifiers`` is read when none are given)."""
    del runtime  # see the module doc: nothing in today's runtime vetoes the shortcut
    if config.algorithm.old_logp_source != "replay":
        return False
    return bool(replay_reasons(config, modifiers))
