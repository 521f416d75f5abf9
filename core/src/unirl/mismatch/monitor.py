"""The trainer's side of the mismatch diagnostics: what to keep, when to replay, which metrics.

Three terms, each with the statistics of :mod:`unirl.mismatch.stats` (docs/mismatch.md):

* ``total``: the behaviour log-probs (the engine's, ``Sample.rollout_logprobs``) against the trainer's
  replay at the weights being trained (pi_old at the batch start). Free every step: the actor's first
  update computes it in its own forward (``micro_batch_loss``), a pi_old replay where one runs;
* ``numerics``: the behaviour log-probs against the trainer's replay at the version that sampled each
  token (``Sample.versions``): the engine's kernels, dtype and sampling against the trainer's;
* ``staleness``: that replay against the replay at the weights being trained: how far the policy moved.

A token sampled by the weights being trained (the actor has not stepped since that version's publish:
every token in sync mode) has its replay at its version equal to the trained one, so its staleness is 0
by construction and its numerics is its total: nothing more runs. Any other token is replayed at its
version every ``diagnostics.mismatch_every`` steps, against the weights the actor kept at that
version's publish (:meth:`unirl.contracts.Actor.hold_version`, only the versions within
``rollout.max_staleness`` of the newest); a token whose version is no longer held (a resume) is
counted in ``mismatch/unheld_tokens`` and left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from unirl.mismatch.alarm import MismatchAlarm
from unirl.mismatch.stats import MismatchSums, log_ratio_sums

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import RunConfig
    from unirl.contracts import Actor
    from unirl.samples import Sample


def loss_mask(s: Sample) -> torch.Tensor:
    """The tokens a step compares: the policy's (``loss_mask`` 1; all when empty)."""
    return torch.tensor([bool(m) for m in (s.loss_mask or [1] * len(s.response_ids))], dtype=torch.bool)


def sampled_by(s: Sample) -> set[int]:
    """The versions that sampled the sample's compared tokens (plain Python: asked every step)."""
    versions = s.versions or [-1] * len(s.response_ids)
    return {v for v, m in zip(versions, s.loss_mask or [1] * len(versions), strict=True) if m}


def version_masks(s: Sample) -> dict[int, torch.Tensor]:
    """``{version: mask}`` of the sample's compared tokens, by the version that sampled each."""
    mask, versions = loss_mask(s), torch.tensor(list(s.versions) or [-1] * len(s.response_ids), dtype=torch.long)
    return {int(v): mask & (versions == v) for v in versions[mask].unique().tolist()}


def train_total(samples: Sequence[Sample], batch: dict[str, Any], train_metrics: list[dict[str, float]],
                replayed: bool) -> MismatchSums | None:
    """The step's ``total`` sums: popped out of each update's metrics (the actor's own forwards, where no
    pi_old was given) plus each replayed pi_old in ``batch`` (``replayed``: ``old_logp_source: replay``)."""
    parts = [p for p in (MismatchSums.pop_from(m) for m in train_metrics) if p is not None]
    if replayed and "old_logprobs" in batch:
        idx = [i for i, o in enumerate(batch["old_logprobs"]) if o is not None and len(samples[i].response_ids)]
        if idx:
            parts.append(cat_sums([torch.as_tensor(batch["rollout_logprobs"][i]) for i in idx],
                                  [batch["old_logprobs"][i] for i in idx], [loss_mask(samples[i]) for i in idx]))
    return sum(parts, MismatchSums()) if parts else None


def cat_sums(reference: Sequence[torch.Tensor], trainer: Sequence[torch.Tensor],
             masks: Sequence[torch.Tensor]) -> MismatchSums:
    """:func:`log_ratio_sums` over many samples at once (one call, not one per sample: a step's batch)."""
    if not masks:
        return MismatchSums()
    flat = [torch.cat([t.detach().reshape(-1).float().cpu() for t in ts]) for ts in (reference, trainer)]
    return log_ratio_sums(flat[0], flat[1], torch.cat([m.reshape(-1) for m in masks]))


@dataclass
class Measured:
    """What :meth:`MismatchMonitor.before_update` found: ``fresh`` (every token at the trained version:
    numerics is the total, staleness 0), or the three terms' sums and the tokens left out."""

    fresh: bool = False
    numerics: MismatchSums = field(default_factory=MismatchSums)
    staleness: MismatchSums = field(default_factory=MismatchSums)
    total: MismatchSums = field(default_factory=MismatchSums)
    unheld: int = 0


class MismatchMonitor:
    """One run's diagnostics state: the version the actor's weights are, the versions it holds, the alarm."""

    def __init__(self, config: RunConfig, *, parity_on: bool = False) -> None:
        self.config, self.every = config, config.diagnostics.mismatch_every
        # sync mode never replays an older version: every token is at the trained one
        self.keeps = self.every > 0 and config.rollout.mode != "sync"
        self.window = config.rollout.max_staleness
        self.trained: int | None = None  # the published version the actor's weights still are (None: stepped)
        self.held: set[int] = set()
        self.alarm = MismatchAlarm(config, parity_on=parity_on)

    def published(self, version: int, actor: Actor) -> None:
        """At each committed publish: the actor's weights are ``version``; keep them when replays may need them."""
        self.trained = version
        if self.keeps and actor.keeps_versions:  # an actor that cannot: older tokens count as unheld
            keep = set(range(version - self.window, version + 1))
            actor.hold_version(version, keep)
            self.held = (self.held | {version}) & keep

    def updated(self) -> None:
        """After an optimizer update: the actor's weights are no published version."""
        self.trained = None

    def before_update(self, step: int, samples: Sequence[Sample], batch: dict[str, Any],
                      actor: Actor) -> Measured | None:
        """Before the step's first update (the weights are still the trained ones): :class:`Measured`, or
        None when this step measures nothing (off, or not a ``mismatch_every`` step)."""
        if self.every == 0:
            return None
        replayed = self.config.algorithm.old_logp_source == "replay"
        if replayed and all(sampled_by(s) <= {self.trained} for s in samples):
            return Measured(fresh=True)
        if step % self.every:
            return None
        masks = [version_masks(s) for s in samples]
        # the trained weights' replay: pi_old where the step replayed it, the rest replayed here
        old = batch.get("old_logprobs") if replayed else None
        current = list(old) if old is not None else [None] * len(samples)
        missing = [i for i, o in enumerate(current) if o is None]
        if missing:
            for i, lp in zip(missing, actor.logprobs([samples[i] for i in missing]), strict=True):
                current[i] = lp
        return self._decompose(samples, masks, current, actor)

    def _decompose(self, samples: Sequence[Sample], masks: list[dict[int, torch.Tensor]],
                   current: list[torch.Tensor], actor: Actor) -> Measured:
        behaviour = [torch.tensor(s.rollout_logprobs, dtype=torch.float32) for s in samples]
        out = Measured(total=cat_sums(behaviour, current, [loss_mask(s) for s in samples]))
        for v in sorted({v for m in masks for v in m}):
            idx = [i for i, m in enumerate(masks) if v in m]
            mv = [masks[i][v] for i in idx]
            if v == self.trained:  # sampled by the weights being trained: staleness 0 by construction
                out.numerics += cat_sums([behaviour[i] for i in idx], [current[i] for i in idx], mv)
                out.staleness += MismatchSums.zero(sum(int(m.sum()) for m in mv))
            elif v not in self.held:
                out.unheld += sum(int(m.sum()) for m in mv)
            else:
                at_v = actor.logprobs_at(v, [samples[i] for i in idx])
                out.numerics += cat_sums([behaviour[i] for i in idx], at_v, mv)
                out.staleness += cat_sums(at_v, [current[i] for i in idx], mv)
        return out

    def metrics(self, step: int, measured: Measured | None, total: MismatchSums | None) -> dict[str, float]:
        """The step's ``mismatch/*`` metrics (``total`` from :func:`train_total`); the alarm checks numerics."""
        out: dict[str, float] = {}
        if measured is not None and not measured.fresh:
            total = measured.total
        if total is not None and total.tokens:
            out.update(total.metrics("total"))
        if measured is None:
            return out
        if measured.fresh:
            if total is None:
                return out
            numerics, staleness = total, MismatchSums.zero(total.tokens)
        else:
            numerics, staleness = measured.numerics, measured.staleness
            out["mismatch/unheld_tokens"] = float(measured.unheld)
        out.update(numerics.metrics("numerics"))
        out.update(staleness.metrics("staleness"))
        if numerics.tokens and self.alarm.check(step, numerics.mean("k3")):
            out["mismatch/alarm"] = 1.0
        return out
