r"""The mismatch statistics between two per-token log-prob tensors, as pure functions.

For a token with log-prob ``a`` on the reference side (the one the token was sampled from, or stands in
for it) and ``b`` on the trainer side, ``r = b - a`` (a log-ratio, e.g. ``logp_train - logp_behaviour``).
Over the compared tokens (``loss_mask`` 1), with ``N`` their count:

* ``abs_mean``  ``= sum |r| / N``: the mean |dlogp|;
* ``k3``        ``= sum (exp(r) - 1 - r) / N``: Schulman's k3 estimator of ``KL(ref || trainer)`` (the tokens
  were drawn from the reference side, so ``exp(r)`` is the ratio ``trainer / ref`` at a sample of ``ref``;
  each term is >= 0 and unbiased; http://joschu.net/blog/kl-approx.html). ``r`` is clamped to
  ``[-20, 20]`` first, as the losses clamp their log-ratios, so a wild token cannot overflow the sum;
* ``frac_gt_1e-3``, ``frac_gt_1e-1``: the share of tokens with ``|r| > 1e-3`` and ``> 1e-1``.

Why sums and not means: a step's tokens come in pieces (micro-batches, FSDP ranks, weight versions), and
sums add exactly; :meth:`MismatchSums.metrics` divides once at the end. The three terms the trainer
reports (docs/mismatch.md) are ``total`` (behaviour vs the trained weights' replay), ``numerics``
(behaviour vs the replay at the version that sampled the token) and ``staleness`` (that replay vs the
trained weights'); their log-ratios add (``r_total = r_numerics + r_staleness``), the statistics do not.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

#: log-ratios are clamped to this before the k3 term (exp stays finite in float64)
K3_CLAMP = 20.0
#: the |r| bounds whose shares are reported
BOUNDS = (("frac_gt_1e-3", 1e-3), ("frac_gt_1e-1", 1e-1))
#: the key prefix of every metric
PREFIX = "mismatch/"


@dataclass
class MismatchSums:
    """Sums over compared tokens: count, |r|, k3 terms and the tokens beyond each bound (float64)."""

    tokens: float = 0.0
    abs_sum: float = 0.0
    k3_sum: float = 0.0
    over_1e3: float = 0.0
    over_1e1: float = 0.0

    def __add__(self, other: MismatchSums) -> MismatchSums:
        return MismatchSums(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @classmethod
    def zero(cls, tokens: float) -> MismatchSums:
        """``tokens`` compared and equal: every sum 0 (what a term is by construction, computed nothing)."""
        return cls(tokens=float(tokens))

    def mean(self, name: str) -> float:
        """``abs_mean``, ``k3`` or a ``frac_gt_*`` share (0.0 over no tokens)."""
        value = {"abs_mean": self.abs_sum, "k3": self.k3_sum, "frac_gt_1e-3": self.over_1e3,
                 "frac_gt_1e-1": self.over_1e1}[name]
        return value / self.tokens if self.tokens else 0.0

    def metrics(self, term: str) -> dict[str, float]:
        """``mismatch/<term>_<stat>`` for each statistic of the module doc."""
        return {f"{PREFIX}{term}_{name}": self.mean(name) for name in ("abs_mean", "k3", *(b for b, _ in BOUNDS))}

    def as_tensor_metrics(self) -> dict[str, float]:
        """The raw sums under private keys, for an actor's sum-reduced micro-batch metrics."""
        return {f"{PREFIX}_{f.name}": getattr(self, f.name) for f in fields(self)}

    @classmethod
    def pop_from(cls, metrics: dict[str, float]) -> MismatchSums | None:
        """Take :meth:`as_tensor_metrics`'s keys out of ``metrics`` (None when absent)."""
        keys = [f"{PREFIX}_{f.name}" for f in fields(cls)]
        if keys[0] not in metrics:
            return None
        return cls(*(float(metrics.pop(k)) for k in keys))


def log_ratio_sums(reference: Tensor, trainer: Tensor, mask: Tensor | None = None) -> MismatchSums:
    """The sums of the module doc for ``r = trainer - reference`` over ``mask`` (bool or 0/1; None: all)."""
    import torch

    r = trainer.detach().reshape(-1).double() - reference.detach().reshape(-1).double().to(trainer.device)
    if mask is not None:
        r = r[mask.reshape(-1).to(r.device) > 0]
    if not r.numel():
        return MismatchSums()
    a = r.abs()
    rc = r.clamp(-K3_CLAMP, K3_CLAMP)
    k3 = torch.expm1(rc) - rc  # exp(r) - 1 - r, without the cancellation of exp(r) - 1 near r = 0
    return MismatchSums(tokens=float(r.numel()), abs_sum=float(a.sum()), k3_sum=float(k3.sum()),
                        over_1e3=float((a > BOUNDS[0][1]).sum()), over_1e1=float((a > BOUNDS[1][1]).sum()))
