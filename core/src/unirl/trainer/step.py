"""The training half of a step, shared by every driver: pi_old, KL, advantages, modifiers, updates.

Why apart from the loop: what a scored batch becomes (the order pi_old replay -> KL -> estimator ->
modifiers -> optimizer steps) is the algorithm, and it is the same whether the batch came from a sync
rollout, a controller's collect or an async reap.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from unirl.algorithms.shaping import apply_kl_in_reward, apply_overlong_penalty
from unirl.config import RunConfig
from unirl.contracts import StepInfo
from unirl.mismatch.monitor import MismatchMonitor, train_total
from unirl.rewards.build import reward_term_metrics
from unirl.samples import Sample, chunks
from unirl.trainer.components import Components
from unirl.trainer.phases import phase
from unirl.trainer.replay import replay_later, replay_scope
from unirl.trainer.rollouts import first_error, mean_reward


def to_tensors(values: list[list[float]]) -> list[torch.Tensor]:
    return [torch.tensor(v, dtype=torch.float32) for v in values]


@dataclass
class ScoredBatch:
    """What one training step consumes: scored samples (whole groups) and how they were collected."""

    samples: list[Sample]
    task_reward: float  # the policy's task reward: first round, before filtering and shaping
    failed: int
    rollout_tokens: int
    rolled: int = 0  # samples rolled out, every round (0: len(samples)); the failed fraction's denominator
    timings: dict[str, float] = field(default_factory=dict)
    shaping: dict[str, float] = field(default_factory=dict)
    failure_example: str | None = None  # the latest round's first failed sample's error (None: none failed)

    @classmethod
    def of(cls, samples: list[Sample], timings: dict[str, float],
           shaping: dict[str, float] | None = None) -> ScoredBatch:
        """One round of rollouts trained as they came (a controller's collect, an async reap): nothing
        filtered, so the task reward, failures and tokens are those of ``samples`` themselves."""
        return cls(samples, task_reward=mean_reward(samples), failed=sum(s.failed for s in samples),
                   rollout_tokens=sum(len(s.response_ids) for s in samples), timings=timings,
                   shaping=shaping or {}, failure_example=first_error(samples))


def train_on_batch(step: int, scored: ScoredBatch, c: Components, config: RunConfig,
                   mismatch: MismatchMonitor | None = None) -> dict[str, Any]:
    """The training half of a step, shared by every driver: pi_old, advantages, modifiers, updates;
    ``mismatch`` (the run's :class:`MismatchMonitor`, None: no diagnostics) measures the batch before them."""
    a, samples, timings, shaping = config.algorithm, scored.samples, dict(scored.timings), dict(scored.shaping)
    for s in samples:  # an infrastructure failure is not a genuine miss: it takes no part in the loss
        if s.failed:
            s.loss_mask = [0] * len(s.response_ids)
    if a.overlong.enabled:  # DAPO's soft overlong punishment, added to the reward
        shaping.update(apply_overlong_penalty(samples, max_len=config.rollout.max_new_tokens,
                                              buffer=a.overlong.buffer_tokens, penalty=a.overlong.penalty))
    with phase("replay", timings):
        # updates_per_batch optimizer steps over disjoint mini-batches; pi_old stays frozen at the batch start.
        order = list(range(len(samples)))
        random.Random(config.run.seed * 1_000_003 + step).shuffle(order)
        updates = list(chunks(order, math.ceil(len(samples) / a.updates_per_batch)))
        batch = behaviour_logprobs(samples, updates, c, config, shaping)
        values = c.actor.values(samples) if c.runtime.estimator.needs_values else None
        adv = c.estimator(samples, options=c.runtime.estimator_options, algorithm=a, values=values)
        batch["advantages"] = adv.advantages
        if adv.returns is not None:
            batch["returns"], batch["old_values"] = adv.returns, values
        modifier_metrics: dict[str, float] = {}
        for modifier in c.modifiers:  # e.g. importance-sampling correction: reweights batch["token_weights"]
            modifier_metrics.update(modifier(samples, batch, config) or {})
        # numerics vs staleness, before any update moves the weights (unirl.mismatch, docs/mismatch.md)
        measured = mismatch.before_update(step, samples, batch, c.actor) if mismatch is not None else None

    with phase("train", timings):
        train_metrics: list[dict[str, float]] = []
        # The parity gate (and any other unirl_before_backward hook) runs inside, on every micro-batch.
        nonfinite: dict[str, Any] = {}
        for update, idx in enumerate(updates):
            mb = [samples[i] for i in idx]
            mb_batch = {k: [v[i] for i in idx] for k, v in batch.items() if not (k == "old_logprobs" and v[idx[0]] is None)}
            train_metrics.append(c.actor.train_step(mb, mb_batch, StepInfo(rl_step=step, update=update)))
            first = train_metrics[-1].pop("nonfinite_first", None)
            if first is not None:  # the actor dropped this update (algorithm.nonfinite)
                nonfinite["nonfinite_updates"] = nonfinite.get("nonfinite_updates", 0) + 1
                nonfinite.setdefault("nonfinite_first", first)
                nonfinite.setdefault("nonfinite_samples", []).extend(s.id for s in mb)
    total = train_total(samples, batch, train_metrics, a.old_logp_source == "replay")  # pops the actor's sums
    diagnostics = mismatch.metrics(step, measured, total) if mismatch is not None else {}
    if mismatch is not None:
        mismatch.updated()
    return step_metrics(step, scored, batch, train_metrics, config, {**adv.metrics, **shaping,
                        **reward_term_metrics(samples), **modifier_metrics, **timings, **nonfinite, **diagnostics})


def behaviour_logprobs(samples: list[Sample], updates: list[list[int]], c: Components, config: RunConfig,
                       shaping: dict[str, float]) -> dict[str, list[torch.Tensor]]:
    """The batch's per-token log-probs before any update: the engine's, pi_old and the KL reference
    (with ``kl_form: reward`` the penalty goes into the rewards here, so the loss carries no KL term)."""
    a = config.algorithm
    rollout_logp = to_tensors([s.rollout_logprobs for s in samples])
    batch: dict[str, list[torch.Tensor]] = {"rollout_logprobs": rollout_logp}
    # pi_old: the engine's log-probs, a replay, or (nothing reads pi_old before the first update) absent
    # for the first mini-batch, whose own forward is pi_old bit for bit (unirl.trainer.replay)
    scope = replay_scope(config, c.modifiers)
    if a.old_logp_source == "rollout":
        batch["old_logprobs"] = rollout_logp
    elif scope == "all":
        batch["old_logprobs"] = c.actor.logprobs(samples)
    elif scope == "later":  # only the mini-batches after the first; None for the first one's samples
        batch["old_logprobs"] = replay_later(c.actor, samples, updates)
    if a.kl_coef > 0:
        batch["ref_logprobs"] = c.actor.ref_logprobs(samples)
        if a.kl_form == "reward":
            shaping.update(apply_kl_in_reward(samples, batch["old_logprobs"], batch["ref_logprobs"],
                                              kl_coef=a.kl_coef, estimator=a.kl_estimator, clamp=a.kl_clamp))
    return batch


def step_metrics(step: int, scored: ScoredBatch, batch: dict[str, list[torch.Tensor]],
                 train_metrics: list[dict[str, float]], config: RunConfig, extra: dict[str, Any]) -> dict[str, Any]:
    """One step's metrics row: the batch, the mean of the updates' metrics, then ``extra`` (estimator,
    shaping, reward terms, modifiers, timings), and the engine-vs-trainer log-prob gap."""
    samples = scored.samples
    metrics: dict[str, Any] = {
        "step": step + 1,
        "reward": scored.task_reward,
        "failed": scored.failed,
        "response_len": sum(len(s.response_ids) for s in samples) / len(samples),
        "truncated": sum(s.status == "truncated" for s in samples) / len(samples),
        "rollout_tokens": scored.rollout_tokens,
        **{k: sum(m[k] for m in train_metrics) / len(train_metrics) for k in train_metrics[0]
           if k != "rollout_replay_max_diff"},
        **extra,
        # of every sample rolled out this step (after the estimator's own: with dynamic sampling, its
        # failed_frac counts only the kept groups)
        "failed_frac": scored.failed / (scored.rolled or len(samples)),
    }
    # engine numerics vs the trainer's: from the replay, and from a forward that stood in for it
    diffs = [m["rollout_replay_max_diff"] for m in train_metrics if "rollout_replay_max_diff" in m]
    if "old_logprobs" in batch and config.algorithm.old_logp_source == "replay":
        diffs += [(o - r).abs().max().item() for o, r in zip(batch["old_logprobs"], batch["rollout_logprobs"], strict=True)
                  if o is not None and len(r)]
    if diffs:
        metrics["rollout_replay_max_diff"] = max(diffs)
    return metrics
