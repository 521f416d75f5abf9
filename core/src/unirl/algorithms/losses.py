r"""Policy and value losses over one micro-batch of flat per-token tensors.

The actor concatenates the response tokens of a micro-batch into flat ``[N]`` tensors (see
:class:`LossInputs`) and calls the loss once per micro-batch. Every loss here returns the **sum-form
partial loss** of that micro-batch: its share of the full-batch loss, divided by *global* denominators
the caller computes once over the whole optimizer step (all micro-batches, all ranks). Hence

    sum over micro-batches (and ranks) of ppo_clip(micro_batch) == ppo_clip(whole batch)

exactly, for the value and for the gradient, however the batch is cut. The actor calls ``backward`` on
each micro-batch's loss as is (no division by the number of micro-batches) and, under FSDP/DDP, must undo
the gradient *averaging* over ranks (multiply the loss by the world size, or all-reduce with SUM), since
the denominators are already global.

PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with asymmetric clipping (DAPO's
clip-higher, Yu et al. 2025, arXiv:2503.14476), per masked-in token t::

    ratio_t = exp(logp_t - old_t)
    l_t     = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_low, 1 + clip_high)) * w_t
              + kl_coef * kl_t                                  (only when kl_coef > 0 and ref given)

``w_t`` is ``token_weights`` (loss modifiers, e.g. importance-sampling rollout correction); it scales the
policy-gradient term only, not the KL penalty (as verl does). The gradient is
``d l_t / d logp_t = -A_t * ratio_t * w_t`` where the unclipped branch is the max, and 0 where the clipped
branch is strictly larger (ratio > 1 + clip_high with A > 0, or ratio < 1 - clip_low with A < 0).

KL to the reference policy, with s = ref - logp (Schulman, *Approximating KL Divergence*, 2020):
``k1 = logp - ref = -s`` (unbiased, can be negative) and ``k3 = exp(s) - s - 1`` (unbiased, >= 0, low
variance).

Aggregations (``algorithm.loss_agg``), with m_t the 0/1 mask and S the sequences of the micro-batch:

* ``token-mean``: ``sum_t l_t m_t / total_tokens`` (total_tokens: global count of masked-in tokens).
* ``seq-mean-token-mean``: ``sum_s [sum_{t in s} l_t m_t / max(seq_len_s, 1)] / total_seqs``.
* ``seq-mean-token-sum-norm`` (Dr. GRPO, arXiv:2503.20783): ``sum_s [sum_{t in s} l_t m_t / norm_len]
  / total_seqs``, with ``norm_len`` a constant (the generation budget, ``rollout.max_new_tokens``), so
  that long responses are not down-weighted per token.

``total_seqs`` is whatever count the caller wants the batch mean over; counting the sequences with at
least one masked-in token (so failed / fully masked ones are not counted) is the natural choice.
Denominators <= 0 are treated as 1 (then every numerator is 0 too), so an all-masked batch gives 0, not NaN.

Numerical safety: masked-out tokens are excluded with ``torch.where`` *before* any exp (their log-ratio
is set to 0), so garbage or infinite values there produce neither NaN losses nor NaN gradients; the
log-ratios are clamped to [-20, 20] before exp.

Metrics are detached 0-d tensors. All are in sum form over the micro-batch with the global
``total_tokens`` (or, for ``pg_loss``, the loss's own denominators), so the actor **sums** them over
micro-batches and ranks, except ``ratio_max`` which it **max**-reduces. :data:`METRIC_REDUCE` says which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "AGGREGATIONS",
    "METRIC_REDUCE",
    "LossInputs",
    "aggregate",
    "entropy_from_logits",
    "kl_penalty",
    "metric_reduce_of",
    "ppo_clip",
    "value_loss",
]

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")

#: How to combine each metric over micro-batches and ranks: "sum" (already divided by global
#: denominators) or "max".
METRIC_REDUCE: dict[str, str] = {
    "pg_loss": "sum",
    "clip_frac": "sum",
    "approx_kl": "sum",
    "kl": "sum",
    "ratio_max": "max",
    "vf_loss": "sum",
    "vf_clip_frac": "sum",
    "vf_error": "sum",
}

_LOG_RATIO_LIMIT = 20.0


def metric_reduce_of(loss: object) -> dict[str, str]:
    """How a policy loss's metrics reduce: its ``metric_reduce`` attribute over :data:`METRIC_REDUCE`.

    A plugin loss with a new max-type metric declares ``fn.metric_reduce = {"my_max": "max"}``;
    unlisted metrics sum."""
    declared = getattr(loss, "metric_reduce", None) or {}
    bad = {k: v for k, v in declared.items() if v not in ("sum", "max")}
    if bad:
        from unirl.kernel.errors import PluginError

        raise PluginError(f"policy loss {getattr(loss, '__name__', loss)!r}: metric_reduce {bad} must be 'sum' or 'max'")
    return {**METRIC_REDUCE, **declared}


@dataclass
class LossInputs:
    """Flat per-token tensors of one micro-batch (responses concatenated)."""

    logprobs: Tensor  # [N] current policy, requires grad
    old_logprobs: Tensor  # [N] policy that the advantages refer to (replay or rollout)
    advantages: Tensor  # [N]
    mask: Tensor  # [N] float 0/1 (loss mask)
    seq_index: Tensor  # [N] long, which sequence (0..S-1 within this micro-batch) each token belongs to
    seq_lens: Tensor  # [S] number of MASKED-IN tokens per sequence in this micro-batch (may be 0)


def _denom(x: float | Tensor) -> float | Tensor:
    if isinstance(x, Tensor):
        return torch.where(x > 0, x, torch.ones_like(x))
    x = float(x)
    return x if x > 0 else 1.0


def aggregate(
    per_token: Tensor,
    seq_index: Tensor,
    seq_lens: Tensor,
    *,
    agg: str,
    total_tokens: float,
    total_seqs: float,
    norm_len: float,
) -> Tensor:
    """Sum-form aggregation of ``per_token`` (already 0 on masked-out tokens). See module doc."""
    if agg == "token-mean":
        return per_token.sum() / _denom(total_tokens)
    if agg == "seq-mean-token-mean":
        num_seqs = seq_lens.numel()
        per_seq = per_token.new_zeros(num_seqs).index_add(0, seq_index, per_token)
        lens = seq_lens.to(per_token.dtype).clamp(min=1)
        return (per_seq / lens).sum() / _denom(total_seqs)
    if agg == "seq-mean-token-sum-norm":
        # sum_s sum_{t in s} l_t / norm_len == sum_t l_t / norm_len: no per-sequence split needed.
        return per_token.sum() / _denom(norm_len) / _denom(total_seqs)
    raise ValueError(f"unknown loss aggregation {agg!r} (known: {', '.join(AGGREGATIONS)})")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi: ``k1`` or ``k3`` (see module doc)."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k3":
        s = (ref_logprobs - logprobs).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
        return torch.exp(s) - s - 1.0
    raise ValueError(f"unknown kl estimator {estimator!r} (known: k1, k3)")


def _check(n: int, **tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and tuple(t.shape) != (n,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({n},)")


def ppo_clip(
    inp: LossInputs,
    *,
    clip_low: float,
    clip_high: float,
    agg: str,
    total_tokens: float,
    total_seqs: float,
    norm_len: float,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (+ optional KL penalty), sum-form over this micro-batch. See module doc.

    Returns ``(loss, metrics)``; ``loss`` is a 0-d tensor in the dtype of ``logprobs`` promoted to at
    least fp32, connected to ``logprobs``'s graph (also when N = 0).
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r} (known: {', '.join(AGGREGATIONS)})")
    logp = inp.logprobs
    n = logp.shape[0] if logp.dim() == 1 else -1
    _check(n, logprobs=logp, old_logprobs=inp.old_logprobs, advantages=inp.advantages, mask=inp.mask,
           seq_index=inp.seq_index, ref_logprobs=ref_logprobs, token_weights=token_weights)
    dtype = torch.promote_types(logp.dtype, torch.float32)
    logp = logp.to(dtype)
    m = inp.mask > 0
    zero = logp.new_zeros(())

    old = inp.old_logprobs.detach().to(dtype)
    adv = torch.where(m, inp.advantages.detach().to(dtype), zero)
    log_ratio = torch.where(m, logp - old, zero).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = pg_clipped > pg_unclipped
    pg = torch.where(clipped, pg_clipped, pg_unclipped)
    if token_weights is not None:
        pg = pg * torch.where(m, token_weights.detach().to(dtype), zero)
    pg = torch.where(m, pg, zero)

    def agg_(x: Tensor) -> Tensor:
        return aggregate(x, inp.seq_index, inp.seq_lens, agg=agg, total_tokens=total_tokens,
                         total_seqs=total_seqs, norm_len=norm_len)

    pg_loss = agg_(pg)
    loss = pg_loss
    with torch.no_grad():
        tok = _denom(total_tokens)
        lr = log_ratio.detach()
        metrics = {
            "pg_loss": pg_loss.detach(),
            "clip_frac": (clipped & m).to(dtype).sum() / tok,
            # KL(pi_old || pi) from samples of pi_old, k3 form: (ratio - 1) - log ratio >= 0
            "approx_kl": torch.where(m, torch.expm1(lr) - lr, zero).sum() / tok,
            "ratio_max": torch.where(m, ratio.detach(), zero).max() if n > 0 else zero.detach(),
        }
    if ref_logprobs is not None:
        ref = ref_logprobs.detach().to(dtype)
        kl = torch.where(m, kl_penalty(torch.where(m, logp, ref), ref, kl_estimator), zero)
        metrics["kl"] = (kl.detach().sum() / _denom(total_tokens))
        if kl_coef > 0:
            loss = loss + kl_coef * agg_(kl)
    return loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None,
    total_tokens: float,
    agg: str = "token-mean",
    seq_index: Tensor | None = None,
    seq_lens: Tensor | None = None,
    total_seqs: float = 1.0,
    norm_len: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped value loss, sum-form with global denominators (default: token-mean).

    Per token: ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2)``; ``clip=None``
    disables clipping (``0.5 * (V - R)^2``). Seq aggregations need ``seq_index`` and ``seq_lens``.
    Metrics (sum form over ``total_tokens``): ``vf_loss``, ``vf_clip_frac`` (tokens where the clipped
    branch is strictly larger, so the gradient is 0), ``vf_error`` (mean squared error (V - R)^2).
    """
    n = values.shape[0] if values.dim() == 1 else -1
    _check(n, values=values, old_values=old_values, returns=returns, mask=mask, seq_index=seq_index)
    if agg != "token-mean" and (seq_index is None or seq_lens is None):
        raise ValueError(f"value_loss with agg={agg!r} needs seq_index and seq_lens")
    if seq_index is None:
        seq_index = torch.zeros(n, dtype=torch.long, device=values.device)
        seq_lens = torch.zeros(1, dtype=torch.long, device=values.device)
    dtype = torch.promote_types(values.dtype, torch.float32)
    m = mask > 0
    zero = values.new_zeros((), dtype=dtype)
    v = torch.where(m, values.to(dtype), zero)
    ret = torch.where(m, returns.detach().to(dtype), zero)
    err = (v - ret) ** 2
    if clip is None:
        per_tok = 0.5 * err
        clipped = torch.zeros_like(m)
    else:
        old = torch.where(m, old_values.detach().to(dtype), zero)
        v_clip = old + (v - old).clamp(-clip, clip)
        err_clip = (v_clip - ret) ** 2
        clipped = err_clip > err
        per_tok = 0.5 * torch.where(clipped, err_clip, err)
    per_tok = torch.where(m, per_tok, zero)
    loss = aggregate(per_tok, seq_index, seq_lens, agg=agg, total_tokens=total_tokens,
                     total_seqs=total_seqs, norm_len=norm_len)
    tok = _denom(total_tokens)
    metrics = {
        "vf_loss": loss.detach(),
        "vf_clip_frac": (clipped & m).to(dtype).sum() / tok,
        "vf_error": torch.where(m, err.detach(), zero).sum() / tok,
    }
    return loss, metrics


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last dim, in fp32 (``[..., V] -> [...]``).

    Stable: works from ``log_softmax``; ``-inf`` logits (masked vocabulary) contribute 0 with finite
    gradients. Apply temperature to ``logits`` first if the entropy should be of the sampling
    distribution. Differentiable (for an entropy bonus); wrap in ``no_grad`` for a metric.
    """
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    safe = torch.where(p > 0, logp, torch.zeros_like(logp))
    return -(p * safe).sum(dim=-1)
