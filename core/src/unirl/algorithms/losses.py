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

**Dual-clip** (Ye et al. 2020, *Mastering Complex Control in MOBA Games with Deep Reinforcement
Learning*, arXiv:1912.09729), option ``clip_ratio_c = c > 1`` of ``ppo_clip`` (``algorithm.loss_options``):
for ``A_t < 0`` the token loss is further bounded above by ``-c * A_t``, i.e.
``l_t = min(max(-A r, -A clip(r)), -c A)``, so a token whose ratio has run far above 1 (a stale or
off-policy sample) cannot dominate the step; its gradient is 0 there. **Off by default**
(``clip_ratio_c: null``): the plain PPO objective is what the PPO, DeepSeekMath, DAPO and Dr. GRPO
papers optimise, the trainer's default is on-policy (``old_logp_source: replay``, a few disjoint
mini-batches) where ratios above 3 are rare, and turning it on silently would change results that were
verified against the papers. verl's default is c = 3; set ``clip_ratio_c: 3`` for that (recommended for
asynchronous / stale rollouts).

**GSPO** (Zheng et al. 2025, *Group Sequence Policy Optimization*, arXiv:2507.18071), loss ``gspo``:
one importance ratio per *sequence*, the geometric mean of its token ratios,
``s_i = exp(1/|y_i| * sum_{t in i} (logp_t - old_t))`` (|y_i| = masked-in tokens of i), clipped with
GSPO's own, much tighter range (``algorithm.loss_options.clip_low/clip_high``, the paper's defaults
3e-4 / 4e-4; ``algorithm.clip_low/clip_high`` are not used by it)::

    l_t = max(-A_t * s_i, -A_t * clip(s_i, 1 - eps_low, 1 + eps_high)) * w_t      for t in i

The gradient flows through ``s_i`` into every token of the sequence: ``d s_i / d logp_t = s_i / |y_i|``.
The paper's objective is ``seq-mean-token-mean`` (then, with one advantage per sequence, the
per-sequence loss is ``-min(s_i A_i, clip(s_i) A_i)``); other aggregations weight the same per-token
terms differently. **GSPO-token** (``gspo_token``, paper eq. 13): ``s_{i,t} = sg[s_i] * pi_t / sg[pi_t]``,
equal to ``s_i`` in value, with gradient ``d s_{i,t} / d logp_t = s_i`` on its own token only, so
token-level advantages can be used. The two have the same loss value, and the same gradient only when
both the advantage and the token weight ``w_t`` are constant within each sequence: ``gspo``'s gradient
reaches every token of i through ``s_i`` (each gets ``-A s_i mean_i(w) / |y_i|`` per unit of
aggregation), ``gspo_token``'s stays on its own token (``-A_t s_i w_t``). So under a loss modifier that
reweights tokens (rollout correction's ``token_tis``), they train differently
(``test_gspo_token_differs_from_gspo_under_token_weights``).

``w_t`` is ``token_weights`` (loss modifiers, e.g. importance-sampling rollout correction); it scales the
policy-gradient term only, not the KL penalty (as verl does). The gradient is
``d l_t / d logp_t = -A_t * ratio_t * w_t`` where the unclipped branch is the max, and 0 where the clipped
branch is strictly larger (ratio > 1 + clip_high with A > 0, or ratio < 1 - clip_low with A < 0).

KL to the reference policy, with s = ref - logp (Schulman, *Approximating KL Divergence*, 2020):
``k1 = logp - ref = -s`` (unbiased, can be negative), ``k2 = 0.5 * s^2`` (biased, >= 0, its gradient is
the true KL's gradient in expectation) and ``k3 = exp(s) - s - 1`` (unbiased, >= 0, low variance).
For ``s`` beyond ~2.5 the k3 value and gradient grow like ``exp(s)``; ``kl_clamp`` (``algorithm.kl_clamp``,
default 10, as verl's ``low_var_kl``) clamps the k3 estimate to ``[-kl_clamp, kl_clamp]`` (gradient 0
where clamped); ``null`` turns the clamp off. k1 and k2 are not clamped.

Aggregations (``algorithm.loss_agg``), with m_t the 0/1 mask and S the sequences of the micro-batch:

* ``token-mean``: ``sum_t l_t m_t / total_tokens`` (total_tokens: global count of masked-in tokens).
* ``seq-mean-token-mean``: ``sum_s [sum_{t in s} l_t m_t / max(seq_len_s, 1)] / total_seqs``.
* ``seq-mean-token-sum``: ``sum_s [sum_{t in s} l_t m_t] / total_seqs`` (each sequence's token *sum*,
  averaged over sequences: long sequences weigh more).
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

Every policy loss is called as ``loss(inp, settings)``: :class:`LossInputs` is what changes per
micro-batch (the tensors, the step's global denominators), :class:`LossSettings` what is fixed for the
run (clip range, aggregation, KL coefficient / estimator / clamp, the loss's own options). The trainer
builds the settings once (:meth:`LossSettings.from_algorithm`, from ``algorithm`` and
``rollout.max_new_tokens``), so no loss restates a dozen keyword arguments and a new run setting is one
field here, not an edit to every loss. A loss declares its ``algorithm.loss_options`` with a pydantic
``Config`` attribute (``ppo_clip``: :class:`PPOClipOptions`, ``gspo``: :class:`GSPOOptions`) and reads
them with :meth:`LossSettings.options_as`.
"""

from __future__ import annotations

import inspect
from dataclasses import KW_ONLY, dataclass
from typing import Any, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "METRIC_REDUCE",
    "GSPOOptions",
    "LossInputs",
    "LossSettings",
    "PPOClipOptions",
    "aggregate",
    "check_loss_signature",
    "entropy_from_logits",
    "gspo",
    "gspo_token",
    "kl_penalty",
    "metric_reduce_of",
    "ppo_clip",
    "value_loss",
]

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
#: verl's low_var_kl clamp: the k3 estimate is kept in [-10, 10]
KL_CLAMP = 10.0

#: How to combine each metric over micro-batches and ranks: "sum" (already divided by global
#: denominators) or "max".
METRIC_REDUCE: dict[str, str] = {
    "pg_loss": "sum",
    "clip_frac": "sum",
    "approx_kl": "sum",
    "kl": "sum",
    "ratio_max": "max",
    "dual_clip_frac": "sum",
    "vf_loss": "sum",
    "vf_clip_frac": "sum",
    "vf_error": "sum",
    # not a loss metric: the actor reports it when it stands in for the skipped pi_old replay
    "rollout_replay_max_diff": "max",
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
    """What a policy loss gets per micro-batch: flat per-token tensors (responses concatenated) and
    the step's *global* denominators (all micro-batches, all ranks; see the module doc)."""

    logprobs: Tensor  # [N] current policy, requires grad
    old_logprobs: Tensor  # [N] policy that the advantages refer to (replay or rollout)
    advantages: Tensor  # [N]
    mask: Tensor  # [N] float 0/1 (loss mask)
    seq_index: Tensor  # [N] long, which sequence (0..S-1 within this micro-batch) each token belongs to
    seq_lens: Tensor  # [S] number of MASKED-IN tokens per sequence in this micro-batch (may be 0)
    _: KW_ONLY
    total_tokens: float  # masked-in tokens of the whole optimizer step
    total_seqs: float  # sequences (with a masked-in token) of the whole optimizer step
    ref_logprobs: Tensor | None = None  # [N] reference policy (KL), when there is one
    token_weights: Tensor | None = None  # [N] loss modifiers' weights on the policy-gradient term


_Options = TypeVar("_Options", bound=BaseModel)

#: the ``algorithm`` field each :class:`LossSettings` field comes from (norm_len: the rollout budget)
_CONFIG_FIELD = {"clip_low": "algorithm.clip_low", "clip_high": "algorithm.clip_high", "agg": "algorithm.loss_agg",
                 "norm_len": "rollout.max_new_tokens", "kl_coef": "algorithm.kl_coef",
                 "kl_estimator": "algorithm.kl_estimator", "kl_clamp": "algorithm.kl_clamp"}


class _SettingError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"LossSettings.{field}: {message}")
        self.field, self.message = field, message


@dataclass(frozen=True)
class LossSettings:
    """A run's policy-loss settings: fixed for the run, built once by the trainer and handed to every
    loss call (``loss(inp, settings)``). Frozen, so no loss or modifier can change them for the calls
    after it; picklable, so FSDP ranks and Ray workers get the same object.

    ``options`` is the loss's ``algorithm.loss_options`` validated against its ``Config`` model (None:
    the loss's defaults); a loss reads it with :meth:`options_as`. ``kl_coef`` is 0 under
    ``algorithm.kl_form: reward`` (the penalty is in the rewards; the loss still reports ``kl``)."""

    clip_low: float
    clip_high: float
    agg: str
    norm_len: float  # Dr. GRPO's constant length (``rollout.max_new_tokens``)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_clamp: float | None = KL_CLAMP
    options: BaseModel | None = None

    def __post_init__(self) -> None:
        if self.agg not in AGGREGATIONS:
            raise _SettingError("agg", f"unknown loss aggregation {self.agg!r} (known: {', '.join(AGGREGATIONS)})")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise _SettingError("kl_estimator", f"unknown kl estimator {self.kl_estimator!r} "
                                f"(known: {', '.join(KL_ESTIMATORS)})")
        for name in ("clip_low", "clip_high", "kl_coef", "norm_len"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and not isinstance(value, bool) and value >= 0):
                raise _SettingError(name, f"must be a number >= 0, got {value!r}")
        if self.kl_clamp is not None and not (isinstance(self.kl_clamp, int | float) and self.kl_clamp > 0):
            raise _SettingError("kl_clamp", f"must be > 0 or null (no clamp), got {self.kl_clamp!r}")

    def options_as(self, model: type[_Options]) -> _Options:
        """The loss's options as ``model`` (its ``Config``): ``model``'s defaults when none are set."""
        if self.options is None:
            return model()
        if not isinstance(self.options, model):
            raise TypeError(f"LossSettings.options is a {type(self.options).__name__}, this loss takes "
                            f"{model.__name__} (build the run's settings with unirl.runtime.build_runtime)")
        return self.options

    @classmethod
    def from_algorithm(cls, algorithm: Any, *, norm_len: float, options: BaseModel | None = None) -> LossSettings:
        """The settings of a run: ``algorithm`` (the config's ``algorithm`` section), ``norm_len``
        (``rollout.max_new_tokens``) and ``options``, the loss's ``algorithm.loss_options`` already
        validated against its ``Config`` (the kernel does that once: ``Kernel.options``, called by
        :func:`unirl.runtime.build_runtime`). A bad value raises
        :class:`~unirl.kernel.errors.ConfigError` naming the config field."""
        from unirl.kernel.errors import ConfigError

        try:
            return cls(clip_low=algorithm.clip_low, clip_high=algorithm.clip_high, agg=algorithm.loss_agg,
                       norm_len=norm_len, kl_coef=0.0 if algorithm.kl_form == "reward" else algorithm.kl_coef,
                       kl_estimator=algorithm.kl_estimator, kl_clamp=algorithm.kl_clamp, options=options)
        except _SettingError as exc:
            raise ConfigError(f"{_CONFIG_FIELD[exc.field]}: {exc.message}") from None


def check_loss_signature(loss: object) -> None:
    """Raise :class:`~unirl.kernel.errors.PluginError` unless ``loss`` can be called as
    ``loss(inp, settings)`` (the ``unirl_policy_losses`` contract), so a plugin written to another
    signature fails at preflight, naming itself, not in the first micro-batch."""
    try:
        inspect.signature(loss).bind(None, None)  # type: ignore[arg-type]
    except TypeError as exc:
        from unirl.kernel.errors import PluginError

        name = getattr(loss, "__name__", loss)
        raise PluginError(f"policy loss {name!r} must be callable as loss(inp: LossInputs, settings: LossSettings) "
                          f"-> (loss, metrics): {exc}") from None
    except ValueError:  # no signature to read (a builtin): it is called as is
        pass


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
    if agg == "seq-mean-token-sum":
        # sum_s sum_{t in s} l_t / total_seqs == sum_t l_t / total_seqs
        return per_token.sum() / _denom(total_seqs)
    if agg == "seq-mean-token-sum-norm":
        # sum_s sum_{t in s} l_t / norm_len == sum_t l_t / norm_len: no per-sequence split needed.
        return per_token.sum() / _denom(norm_len) / _denom(total_seqs)
    raise ValueError(f"unknown loss aggregation {agg!r} (known: {', '.join(AGGREGATIONS)})")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3",
               clamp: float | None = KL_CLAMP) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi: ``k1``, ``k2`` or ``k3``, the k3
    value clamped to ``[-clamp, clamp]`` unless ``clamp`` is None (see module doc)."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs) ** 2
    if estimator == "k3":
        s = (ref_logprobs - logprobs).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
        k3 = torch.exp(s) - s - 1.0
        return k3 if clamp is None else k3.clamp(-clamp, clamp)
    raise ValueError(f"unknown kl estimator {estimator!r} (known: {', '.join(KL_ESTIMATORS)})")


def _check(n: int, **tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and tuple(t.shape) != (n,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({n},)")


class PPOClipOptions(BaseModel):
    """``algorithm.loss_options`` of ``ppo_clip``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    clip_ratio_c: float | None = Field(None, gt=1.0, description="dual-clip bound c (verl: 3); null = off")


class GSPOOptions(BaseModel):
    """``algorithm.loss_options`` of ``gspo`` and ``gspo_token`` (the paper's clip range)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    clip_low: float = Field(3e-4, ge=0, description="sequence-ratio clip below 1 (GSPO paper: 3e-4)")
    clip_high: float = Field(4e-4, ge=0, description="sequence-ratio clip above 1 (GSPO paper: 4e-4)")


def _prepare(inp: LossInputs):
    logp = inp.logprobs
    n = logp.shape[0] if logp.dim() == 1 else -1
    _check(n, logprobs=logp, old_logprobs=inp.old_logprobs, advantages=inp.advantages, mask=inp.mask,
           seq_index=inp.seq_index, ref_logprobs=inp.ref_logprobs, token_weights=inp.token_weights)
    dtype = torch.promote_types(logp.dtype, torch.float32)
    logp = logp.to(dtype)
    m = inp.mask > 0
    zero = logp.new_zeros(())
    old = inp.old_logprobs.detach().to(dtype)
    adv = torch.where(m, inp.advantages.detach().to(dtype), zero)
    log_ratio = torch.where(m, logp - old, zero).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    return n, dtype, logp, m, zero, adv, log_ratio


def _finish(inp: LossInputs, settings: LossSettings, pg: Tensor, clipped: Tensor, ratio: Tensor,
            log_ratio: Tensor, *, n: int, dtype: torch.dtype, logp: Tensor, m: Tensor,
            zero: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Token weights, aggregation, metrics and the KL-in-loss term shared by the clipped losses."""
    total_tokens, ref_logprobs = inp.total_tokens, inp.ref_logprobs
    if inp.token_weights is not None:
        pg = pg * torch.where(m, inp.token_weights.detach().to(dtype), zero)
    pg = torch.where(m, pg, zero)

    def agg_(x: Tensor) -> Tensor:
        return aggregate(x, inp.seq_index, inp.seq_lens, agg=settings.agg, total_tokens=total_tokens,
                         total_seqs=inp.total_seqs, norm_len=settings.norm_len)

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
        kl = torch.where(m, kl_penalty(torch.where(m, logp, ref), ref, settings.kl_estimator, settings.kl_clamp),
                         zero)
        metrics["kl"] = (kl.detach().sum() / _denom(total_tokens))
        if settings.kl_coef > 0:
            loss = loss + settings.kl_coef * agg_(kl)
    return loss, metrics


def ppo_clip(inp: LossInputs, settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (+ optional dual-clip, + optional KL penalty), sum-form over this
    micro-batch. See module doc.

    Returns ``(loss, metrics)``; ``loss`` is a 0-d tensor in the dtype of ``logprobs`` promoted to at
    least fp32, connected to ``logprobs``'s graph (also when N = 0). With ``clip_ratio_c``
    (:class:`PPOClipOptions`) the metrics include ``dual_clip_frac`` (tokens held at ``-c * A``).
    """
    clip_ratio_c = settings.options_as(PPOClipOptions).clip_ratio_c
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    n, dtype, logp, m, zero, adv, log_ratio = _prepare(inp)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high)
    clipped = pg_clipped > pg_unclipped
    pg = torch.where(clipped, pg_clipped, pg_unclipped)
    dual = None
    if clip_ratio_c is not None:
        bound = -adv * clip_ratio_c
        dual = (adv < 0) & (pg > bound)
        pg = torch.where(dual, bound, pg)
    loss, metrics = _finish(inp, settings, pg, clipped, ratio, log_ratio, n=n, dtype=dtype, logp=logp, m=m,
                            zero=zero)
    if dual is not None:
        metrics["dual_clip_frac"] = ((dual & m).to(dtype).sum() / _denom(inp.total_tokens)).detach()
    return loss, metrics


ppo_clip.Config = PPOClipOptions  # type: ignore[attr-defined]


def _gspo(inp: LossInputs, settings: LossSettings, *, token_level: bool) -> tuple[Tensor, dict[str, Tensor]]:
    clip = settings.options_as(GSPOOptions)  # GSPO's own range, not algorithm.clip_low/high
    n, dtype, logp, m, zero, adv, log_ratio = _prepare(inp)
    num_seqs = inp.seq_lens.numel()
    lens = inp.seq_lens.to(device=logp.device, dtype=dtype).clamp(min=1)
    seq_log_ratio = log_ratio.new_zeros(num_seqs).index_add(0, inp.seq_index, log_ratio) / lens  # [S]
    seq_log_ratio = seq_log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    per_tok = seq_log_ratio[inp.seq_index]  # [N]: s_i of each token's sequence, in log space
    if token_level:  # s_{i,t} = sg[s_i] * pi_t / sg[pi_t]: the value of s_i, the gradient of token t alone
        per_tok = per_tok.detach() + torch.where(m, logp - logp.detach(), zero)
    ratio = torch.exp(per_tok)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - clip.clip_low, 1.0 + clip.clip_high)
    clipped = pg_clipped > pg_unclipped
    pg = torch.where(clipped, pg_clipped, pg_unclipped)
    return _finish(inp, settings, pg, clipped, ratio, log_ratio, n=n, dtype=dtype, logp=logp, m=m, zero=zero)


def gspo(inp: LossInputs, settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: the clipped surrogate on the sequence-level ratio ``s_i`` (see module doc), clipped with
    :class:`GSPOOptions` (paper defaults 3e-4 / 4e-4), not ``settings.clip_low/clip_high``.
    ``ratio_max`` is the largest ``s_i``, ``clip_frac`` counts tokens."""
    return _gspo(inp, settings, token_level=False)


def gspo_token(inp: LossInputs, settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token: ``s_{i,t} = sg[s_i] * pi_t / sg[pi_t]`` (see module doc). Options as :func:`gspo`."""
    return _gspo(inp, settings, token_level=True)


for _fn in (gspo, gspo_token):
    _fn.Config = GSPOOptions  # type: ignore[attr-defined]
    _fn.metric_reduce = {"ratio_max": "max"}  # type: ignore[attr-defined]


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

    Per token: ``0.5 * max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2)``; ``clip=None``
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
        # Clamp V itself (not old + clamp(V - old)): in range, v_clip is V bit for bit, so an in-range
        # token never counts as clipped by a rounding error; out of range it is the (detached) bound.
        v_clip = torch.minimum(torch.maximum(v, old - clip), old + clip)
        err_clip = (v_clip - ret) ** 2
        clipped = ((v - old).abs() > clip) & (err_clip > err)
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
