r"""The ``rollout_correction`` loss modifier: importance weights for off-policy rollout tokens.

Called by the trainer once per step, in its process, after advantages and pi_old are known and before
any mini-batch is cut (``unirl_loss_modifiers``). With ``delta_t = log pi_old(y_t) - log mu(y_t)``
(pi_old: the trainer's replay at the batch start, mu: the rollout engine), over the active tokens
(``loss_mask`` 1) of each response ``s``:

* ``token_tis``  ``w_t = min(exp(clamp(delta_t, -20, 20)), C)``
* ``seq_tis``    ``w_s = min(exp(clamp(sum_{t in s} delta_t, -20, 20)), C)`` on every token of s
* ``token_mask`` ``w_t = 1[L <= exp(clamp(delta_t, -20, 20)) <= U]``
* ``seq_mask``   ``w_s = 1[L <= exp(clamp(sum_{t in s} delta_t, -20, 20)) <= U]``
* ``geo_mask``   ``w_s = 1[L <= exp(clamp(mean_{t in s} delta_t, -20, 20)) <= U]``

with ``C = U = threshold`` and ``L = threshold_lower`` (default ``1 / threshold``). The weights are
detached (the anchors pi_old and mu are frozen for the whole batch, every ``updates_per_batch``
update included), and the policy loss multiplies its clipped per-token term by them keeping its
reduction denominators, so a masked token still counts in ``token-mean``'s denominator. A weight set
by an earlier modifier is multiplied, not replaced. ``mode: none`` leaves ``batch`` untouched.

The returned metrics (``rc/...``) are computed over the **whole step batch** in the trainer's process,
so they are global (all micro-batches, all FSDP ranks), except ``rc/ess_frac_micro*``: the same Kish
ESS computed inside each micro-batch and then averaged, which is what a metric computed in the loss
of one micro-batch reports (the seed's "micro ESS is not global ESS"; see :func:`micro_ess`).
Formulas and sources: docs/rollout-correction.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from unirl.api import UniRLError
from unirl_rollout_correction.options import RolloutCorrectionOptions, options_of

__all__ = ["LOG_CLAMP", "RolloutCorrectionError", "active_masks", "compute_weights", "diagnostics",
           "ess_frac", "micro_ess", "micro_partition", "rollout_correction"]

#: log-ratios are clamped to [-20, 20] before exp (as the loss does), so exp never overflows
LOG_CLAMP = 20.0
#: ids shown in an error message before "... and N more"
_SHOW = 8


class RolloutCorrectionError(UniRLError):
    """The step's batch cannot be corrected (rollout log-probs missing or malformed); names the samples."""


def _ids(ids: Sequence[str]) -> str:
    more = f" ... and {len(ids) - _SHOW} more" if len(ids) > _SHOW else ""
    return ", ".join(ids[:_SHOW]) + more


def active_masks(samples: Sequence[Any]) -> list[Tensor]:
    """Per sample, the bool mask of the tokens that enter the loss (``loss_mask``; all when empty)."""
    out = []
    for s in samples:
        mask = s.loss_mask if s.loss_mask else [1] * len(s.response_ids)
        out.append(torch.tensor([bool(x) for x in mask], dtype=torch.bool))
    return out


def _check(samples: Sequence[Any], batch: dict[str, Any], opts: RolloutCorrectionOptions,
           masks: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """The (old, rollout) per-sample tensors, or a RolloutCorrectionError naming the bad samples."""
    old, roll = batch.get("old_logprobs"), batch.get("rollout_logprobs")
    every = [s.id for s in samples]
    for name, vals in (("rollout_logprobs", roll), ("old_logprobs", old)):
        if vals is None:
            raise RolloutCorrectionError(
                f"rollout_correction: batch['{name}'] is missing for samples {_ids(every)}; the trainer sets it "
                "from each sample's rollout_logprobs (engine) and the actor's replay (pi_old)")
        if len(vals) != len(samples):
            raise RolloutCorrectionError(f"rollout_correction: batch['{name}'] has {len(vals)} entries for "
                                         f"{len(samples)} samples ({_ids(every)})")
    bad = [s.id for s, r in zip(samples, roll, strict=True) if torch.as_tensor(r).numel() != len(s.response_ids)]
    if bad:
        raise RolloutCorrectionError(
            f"rollout_correction: rollout log-probs are missing for samples {_ids(bad)} (fewer entries than "
            "response tokens); the engine must return one log-prob per sampled token (Sample.rollout_logprobs)")
    bad = [s.id for s, o in zip(samples, old, strict=True) if torch.as_tensor(o).numel() != len(s.response_ids)]
    if bad:
        raise RolloutCorrectionError(f"rollout_correction: pi_old log-probs do not match the responses of "
                                     f"samples {_ids(bad)}")
    olds = [torch.as_tensor(o).detach().reshape(-1).to(torch.float64) for o in old]
    rolls = [torch.as_tensor(r).detach().reshape(-1).to(torch.float64) for r in roll]
    bad = [s.id for s, o, r, m in zip(samples, olds, rolls, masks, strict=True)
           if not (bool(torch.isfinite(o[m]).all()) and bool(torch.isfinite(r[m]).all()))]
    if bad:
        raise RolloutCorrectionError(f"rollout_correction: non-finite log-probs on loss tokens of samples {_ids(bad)}")
    if opts.mode != "none" and roll is old:
        raise RolloutCorrectionError(
            f"rollout_correction: mode {opts.mode} but pi_old is the rollout log-probs themselves "
            "(algorithm.old_logp_source: rollout), so every weight would be 1; set old_logp_source: replay")
    return olds, rolls


def compute_weights(deltas: Sequence[Tensor], masks: Sequence[Tensor], opts: RolloutCorrectionOptions
                    ) -> tuple[list[Tensor], list[Tensor]]:
    """Per sample: float64 weights (1 on inactive tokens) and the bool mask of active tokens whose weight
    was truncated (TIS) or zeroed (mask modes). ``deltas`` are 0 on inactive tokens."""
    mode, cap, lower = opts.mode, opts.threshold, opts.lower
    weights, hit = [], []
    for d, m in zip(deltas, masks, strict=True):
        one = torch.ones_like(d)
        if mode == "none":
            w, h = one, torch.zeros_like(m)
        elif mode in ("token_tis", "token_mask"):
            ratio = torch.exp(d.clamp(-LOG_CLAMP, LOG_CLAMP))
            if mode == "token_tis":
                w, h = ratio.clamp(max=cap), ratio > cap
            else:
                keep = (ratio >= lower) & (ratio <= cap)
                w, h = keep.to(d.dtype), ~keep
        else:
            n = int(m.sum())
            log_r = d.sum() / max(n, 1) if mode == "geo_mask" else d.sum()
            ratio = float(torch.exp(log_r.clamp(-LOG_CLAMP, LOG_CLAMP)))
            if mode == "seq_tis":
                ws, affected = min(ratio, cap), ratio > cap
            else:
                affected = not (lower <= ratio <= cap)
                ws = 0.0 if affected else 1.0
            w, h = one * ws, torch.full_like(m, affected)
        weights.append(torch.where(m, w, one))
        hit.append(h & m)
    return weights, hit


def diagnostics(olds: Sequence[Tensor], rolls: Sequence[Tensor], masks: Sequence[Tensor],
                weights: Sequence[Tensor], hit: Sequence[Tensor]) -> dict[str, float]:
    """The step's global diagnostics (see the module doc and docs/rollout-correction.md)."""
    m = torch.cat([x for x in masks]) if masks else torch.zeros(0, dtype=torch.bool)
    n = int(m.sum())
    seqs = [bool(x.any()) for x in masks]
    n_seq = sum(seqs)
    out = {"rc/active_tokens": float(n), "rc/active_seqs": float(n_seq)}
    if n == 0:
        return {**out, "rc/weight_mean": 1.0, "rc/weight_max": 1.0, "rc/weight_min": 1.0,
                "rc/clipped_token_frac": 0.0, "rc/clipped_seq_frac": 0.0, "rc/ess_frac_global": 1.0,
                "rc/logp_diff_abs_mean": 0.0, "rc/logp_diff_abs_max": 0.0, "rc/kl_k3": 0.0, "rc/ppl_ratio": 1.0}
    w = torch.cat(list(weights))[m]
    old, roll = torch.cat(list(olds))[m], torch.cat(list(rolls))[m]
    d = old - roll
    dc = d.clamp(-LOG_CLAMP, LOG_CLAMP)
    sum_w, sum_w2 = float(w.sum()), float((w * w).sum())
    seq_hit = sum(bool(h.any()) for h, live in zip(hit, seqs, strict=True) if live)
    out.update({
        "rc/weight_mean": sum_w / n,
        "rc/weight_max": float(w.max()),
        "rc/weight_min": float(w.min()),
        "rc/clipped_token_frac": float(torch.cat(list(hit))[m].sum()) / n,
        "rc/clipped_seq_frac": seq_hit / max(n_seq, 1),
        "rc/ess_frac_global": (sum_w * sum_w) / (n * sum_w2) if sum_w2 > 0 else 0.0,
        "rc/logp_diff_abs_mean": float(d.abs().mean()),
        "rc/logp_diff_abs_max": float(d.abs().max()),
        # KL(mu || pi_old) from samples of mu, k3 form: r - 1 - log r with r = pi_old / mu
        "rc/kl_k3": float((torch.exp(dc) - 1.0 - dc).mean()),
        # perplexity of the rollout over that of the replay, pooled over tokens: exp(mean(old - roll))
        "rc/ppl_ratio": float(torch.exp(d.mean().clamp(-LOG_CLAMP, LOG_CLAMP))),
    })
    return out


def ess_frac(w: Tensor) -> float:
    """Kish's effective sample size as a fraction of ``len(w)``: ``(sum w)^2 / (n sum w^2)``; 0 when every
    weight is 0, 1.0 for an empty set (nothing was reweighted)."""
    n = int(w.numel())
    if n == 0:
        return 1.0
    sum_w, sum_w2 = float(w.sum()), float((w * w).sum())
    return (sum_w * sum_w) / (n * sum_w2) if sum_w2 > 0 else 0.0


def micro_partition(n_samples: int, updates_per_batch: int, micro_batch_size: int) -> list[list[int]]:
    """Sample indices cut as the actor cuts a step batch: ``updates_per_batch`` mini-batches of
    ``ceil(n / updates_per_batch)`` samples, each cut into micro-batches of ``micro_batch_size``.

    Why in batch order: the trainer shuffles samples into mini-batches with a seed the modifier does not
    see, so these are micro-batches of the actor's sizes, not its exact members (GRPO groups stay together
    here). That is enough for what the metric is for: showing how far a per-micro-batch ESS strays from
    the global one at the sizes the run actually uses."""
    size = max(1, math.ceil(n_samples / max(updates_per_batch, 1)))
    parts = []
    for lo in range(0, n_samples, size):
        mini = list(range(lo, min(lo + size, n_samples)))
        parts += [mini[i:i + micro_batch_size] for i in range(0, len(mini), micro_batch_size)]
    return parts


def micro_ess(weights: Sequence[Tensor], masks: Sequence[Tensor], parts: Sequence[Sequence[int]]
              ) -> dict[str, float]:
    """The micro-local ESS: :func:`ess_frac` over the active tokens of each micro-batch in ``parts``
    (lists of sample indices), then the mean and the min over the micro-batches that have an active token.

    It differs from ``rc/ess_frac_global``: a micro-batch whose weights are all 2 and another whose weights
    are all 0.5 each have ESS 1.0 (mean 1.0), while pooled they have 0.735. Weight variance *between*
    micro-batches is invisible to it, so it reads high when the mismatch varies across the batch."""
    local = []
    for idx in parts:
        w = [weights[i][masks[i]] for i in idx]
        flat = torch.cat(w) if w else torch.zeros(0, dtype=torch.float64)
        if flat.numel():
            local.append(ess_frac(flat))
    if not local:
        return {"rc/ess_frac_micro": 1.0, "rc/ess_frac_micro_min": 1.0, "rc/micro_batches": 0.0}
    return {"rc/ess_frac_micro": sum(local) / len(local), "rc/ess_frac_micro_min": min(local),
            "rc/micro_batches": float(len(local))}


def rollout_correction(samples: Sequence[Any], batch: dict[str, Any], config: Any) -> dict[str, float]:
    """The loss modifier (see the module doc): sets ``batch["token_weights"]`` unless ``mode: none``,
    and returns the step's global ``rc/`` diagnostics."""
    opts = options_of(config)
    masks = active_masks(samples)
    olds, rolls = _check(samples, batch, opts, masks)
    deltas = [torch.where(m, o - r, torch.zeros_like(o)) for o, r, m in zip(olds, rolls, masks, strict=True)]
    weights, hit = compute_weights(deltas, masks, opts)
    metrics = diagnostics(olds, rolls, masks, weights, hit)
    parts = micro_partition(len(samples), config.algorithm.updates_per_batch, config.actor.micro_batch_size)
    metrics.update(micro_ess(weights, masks, parts))
    if opts.mode != "none":
        prev = batch.get("token_weights")
        new = [w.to(torch.float32) for w in weights]
        if prev is not None:
            new = [torch.as_tensor(p).detach().reshape(-1).to(torch.float32) * w for p, w in zip(prev, new, strict=True)]
        batch["token_weights"] = new
    return metrics


