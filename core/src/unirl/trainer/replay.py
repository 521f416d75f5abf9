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
    elif (scope := replay_scope(config, modifiers)) == "all":
        batch["old_logprobs"] = actor.logprobs(samples)
    elif scope == "later":
        batch["old_logprobs"] = replay_later(actor, samples, updates)  # None for the first mini-batch
    # else: absent; each micro-batch's forward supplies pi_old

With ``updates_per_batch > 1`` and nothing else reading pi_old early, only the *later* mini-batches
need the replay (:func:`replay_scope` is ``"later"``): the first update's pi_old is still its own
forward, and :func:`replay_later` replays each later mini-batch on its own, so its replay runs the
micro-batches its training forward runs. ``core/tests/test_replay_later.py`` checks the result
bitwise against replaying the first mini-batch too.

What the skipped replay also fed: the ``rollout_replay_max_diff`` metric (engine vs trainer
numerics) needs the trainer's log-probs, which the before-backward hook sees per micro-batch anyway.

Nothing of the run's runtime enters the decision: core's parity providers run the "replay" and
"train" phases on the same ops, so none could veto the shortcut (a parameter kept for a future veto
was a speculative seam, and made ``runtime`` optional here alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from unirl.config import RunConfig
    from unirl.contracts import Actor

#: what the trainer replays: nothing, the mini-batches after the first, or the whole batch
ReplayScope = Literal["none", "later", "all"]


def _early_readers(config: RunConfig, modifiers: Sequence[Any] = ()) -> list[str]:
    """The settings that read pi_old before the first update (so every sample must be replayed), each
    named for logs and errors."""
    a = config.algorithm
    reasons = []
    if a.kl_coef > 0 and a.kl_form == "reward":
        reasons.append("algorithm.kl_form=reward: the KL penalty reads pi_old before the estimator")
    mods = list(modifiers) or list(a.modifiers)
    if mods:
        names = ", ".join(getattr(m, "__name__", str(m)) for m in mods)
        reasons.append(f"algorithm.modifiers ({names}): a loss modifier may read old_logprobs")
    return reasons


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
    return reasons + _early_readers(config, modifiers)


def old_logprobs_needed(config: RunConfig, modifiers: Sequence[Any] = ()) -> bool:
    """Whether the trainer must run ``actor.logprobs`` (the pi_old replay) before training.

    False when ``old_logp_source`` is ``rollout`` (no replay) or when the training forward's own
    log-probs are pi_old (see the module doc); ``modifiers`` are the loaded loss modifiers (or
    ``config.algorithm.modifiers`` is read when none are given)."""
    if config.algorithm.old_logp_source != "replay":
        return False
    return bool(replay_reasons(config, modifiers))


def replay_scope(config: RunConfig, modifiers: Sequence[Any] = ()) -> ReplayScope:
    """What the trainer replays for pi_old: ``"none"`` (:func:`old_logprobs_needed` is False),
    ``"later"`` (the only reason is ``updates_per_batch > 1``: the first mini-batch's forward is still
    pi_old, so only the later mini-batches are replayed, see :func:`replay_later`) or ``"all"``
    (something reads every sample's pi_old before the first update: ``kl_form: reward``, a modifier)."""
    if not old_logprobs_needed(config, modifiers):
        return "none"
    # needed and nothing reads pi_old early: the only reason left is updates_per_batch > 1
    return "all" if _early_readers(config, modifiers) else "later"


def replay_later(actor: Actor, samples: Sequence[Any], updates: Sequence[Sequence[int]]) -> list[Tensor | None]:
    """pi_old per sample for :func:`replay_scope` ``"later"``: ``actor.logprobs`` of each mini-batch
    after the first (``updates``: the sample indices of each update, in training order), called once
    per mini-batch with its samples in training order, so the replay cuts the same micro-batches as
    that update's training forward; ``None`` for the first mini-batch's samples (their update runs
    without ``old_logprobs``). Every call runs before any update: all of it is the batch-start policy."""
    out: list[Tensor | None] = [None] * len(samples)
    for idx in list(updates)[1:]:
        for i, lp in zip(idx, actor.logprobs([samples[i] for i in idx]), strict=True):
            out[i] = lp
    return out
