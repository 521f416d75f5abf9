r"""Advantage estimators: from rewards (and values) to one advantage per response token.

Every estimator has the same signature, so the trainer calls whichever ``algorithm.estimator`` names::

    est(samples, *, options=runtime.estimator_options, algorithm=algorithm, values=None) -> AdvantageResult

``options`` is the estimator's ``Config`` instance, validated once by the kernel when the run's runtime
is built (:func:`unirl.runtime.build_runtime`), so a step never parses ``algorithm.estimator_options``.
A direct call may pass the raw dict instead: it is validated against the same model.

``AdvantageResult.advantages[i]`` is a 1-D fp32 CPU tensor with one entry per ``samples[i].response_ids``
token, in input order. Outcome estimators (``grpo``, ``dr_grpo``, ``rloo``) give every token of a
trajectory the same value; tokens with ``loss_mask == 0`` keep it, and the loss masks them out.

Groups are ``Sample.group_id`` (the siblings generated from one prompt), so estimators work on any
shuffle or subset of a batch, but a group must be whole in the call (estimate before sharding).

**Failed trajectories** (``Sample.failed``: infrastructure fault, reward NaN) carry no information about
the policy. They are left out of every statistic (group mean, std, count, whitening) and get advantage 0
on every token; a group whose members all failed gets 0 everywhere. A group with one valid member gets
0 (there is no baseline to compare it with).

Estimators
----------
``grpo`` -- Group Relative Policy Optimization (Shao et al. 2024, *DeepSeekMath*, arXiv:2402.03300, eq. 3
    with outcome supervision):  :math:`A_i = (r_i - \mathrm{mean}(r_G)) / (\mathrm{std}(r_G) + \epsilon)`.
    Options:

    * ``scope``: ``"group"`` (default) divides by each group's std; ``"batch"`` divides by the std of all
      valid rewards of the batch (the mean is still the group's). The batch variant ("group mean, batch
      std", Liu et al. 2025 *Part I: Tricks or Traps*, arXiv:2508.08221; verl 0.9 has no such option, its
      closest is ``norm_adv_by_std_in_grpo: false``, i.e. ``dr_grpo``) stops groups with a tiny spread,
      e.g. 7 wrong and 1 right, from being blown up into huge advantages.
    * ``baseline``: ``"mean"`` (default, the paper) or ``"loo"``: each sample's baseline is the mean of
      the *other* valid members of its group (leave-one-out, as in RLOO), still divided by the std:
      :math:`A_i = (r_i - \frac{1}{n-1}\sum_{j\ne i} r_j) / (\mathrm{std}(r_G) + \epsilon)`. The
      baseline no longer depends on ``r_i`` itself, so the numerator is unbiased; it is the mean-baseline
      numerator scaled by n / (n - 1).
    * ``std``: ``"unbiased"`` (default; Bessel-corrected, what ``torch.std`` and therefore verl and TRL
      compute) or ``"biased"`` (divide by n).
    * ``eps``: added to the std (default ``1e-6``). A group whose rewards are all equal gets 0.

``dr_grpo`` -- Dr. GRPO (Liu et al. 2025, *Understanding R1-Zero-Like Training: A Critical Perspective*,
    arXiv:2503.20783): :math:`A_i = r_i - \mathrm{mean}(r_G)`. Dividing by the std weights questions by
    how (un)certain the policy is on them (a difficulty bias); Dr. GRPO drops it. Pair it with
    ``loss_agg: seq-mean-token-sum-norm`` to also drop the length bias. No options.

``rloo`` -- REINFORCE Leave-One-Out (Ahmadian et al. 2024, *Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs*, arXiv:2402.14740; Kool et al. 2019):
    each sample's baseline is the mean reward of the *other* members of its group, which keeps the
    estimator unbiased: :math:`A_i = r_i - \frac{1}{n-1}\sum_{j\ne i} r_j = \frac{n}{n-1}(r_i - \bar r)`,
    with n the number of valid members. No options.

``reinforce_pp`` -- REINFORCE++ (Hu et al. 2025, *REINFORCE++: A Simple and Efficient Approach for
    Aligning Large Language Models*, arXiv:2501.03262): no critic and no group baseline; the baseline is
    the *global batch*: every token's return (here the outcome reward, which already holds a KL-in-reward
    penalty when ``kl_form: reward``) is normalised over all valid tokens of the batch,
    :math:`A = (r - \mathrm{mean}_{batch}) / \mathrm{std}_{batch}` (verl's ``masked_whiten``: token
    statistics, unbiased variance, ``rsqrt(var + 1e-8)``). Works with ``rollout.n = 1``. No options.
    No discount: every token's return is the whole outcome reward (verl discounts it by ``gamma``), so
    preflight refuses ``algorithm.gamma != 1`` with this estimator rather than ignore it.

``reinforce_pp_baseline`` -- REINFORCE++-baseline (same paper, the variant for reasoning with several
    samples per prompt): subtract the group mean first, :math:`r_i - \mathrm{mean}(r_G)`, then normalise
    over the global batch as ``reinforce_pp``. No options.

``gae`` -- Generalized Advantage Estimation (Schulman et al. 2016, *High-Dimensional Continuous Control
    Using Generalized Advantage Estimation*, arXiv:1506.02438), for PPO with a value head. ``values`` is a
    list of per-response-token value estimates aligned with ``response_ids``. The reward is terminal: it
    is placed on the last response token, every other token has reward 0. Each trajectory on its own::

        delta_t = r_t + gamma * V_{t+1} - V_t        (V after the last token = 0: the episode ends)
        A_t     = delta_t + gamma * lam * A_{t+1}    (A after the last token = 0)
        R_t     = A_t + V_t                          (the value target, "returns")

    ``gamma = algorithm.gamma``, ``lam = algorithm.lam``. Options: ``whiten`` (default ``True``):
    normalise the advantages to mean 0 and std 1 over all ``loss_mask == 1`` tokens of the non-failed
    samples of the batch (verl's ``masked_whiten``: unbiased variance, ``(A - mean) * rsqrt(var + 1e-8)``).
    Returns are computed *before* whitening.

    Tokens with ``loss_mask == 0`` (tool observations inside an agentic trajectory) are treated as
    ordinary environment steps with reward 0: the recursion runs through them, so credit flows across
    them with the usual discount. Their advantage is set to 0 in the output (and they do not enter the
    whitening statistics); their returns are kept (the value loss masks them anyway).
    Failed samples: advantage 0, returns = values (so a clipped value loss on them is 0).

Group layers
------------
``algorithm.group_layer`` picks which layer of the sample tree (:mod:`unirl.samples`) forms a group;
every layer's groups lie inside one root group, so estimating before sharding by root keeps them whole.

* ``root`` (default): ``Sample.group_id``, the samples of one launch (everything above).
* ``fork``: ``Sample.fork_group_id``, the branches taken from one fork point (``p17@t/0/f2.0``,
  ``p17@t/0/f2.1``: GRPO over branches). A sample that is not a fork branch belongs to its launch's
  group, as under ``root``.
* ``turn``: the unit is one turn of one sample (:meth:`Sample.turn_list`: the model call and the
  environment's response to it); turn k of every sample of a launch forms a group, with the sample's
  outcome reward. Each turn's tokens get their own group's advantage; a sample with fewer turns is
  simply absent from the later groups, so turn k is compared only with trajectories that got that far.
  Tokens before the first model call get 0. For ``gae``, ``turn`` is turn-level GAE: one step per turn,
  the state value of turn k is ``V_k = values[start of turn k]`` (the value of its conditioning), the
  reward is terminal (on the last turn)::

      delta_k = r_k + gamma * V_{k+1} - V_k        (V_K = 0 after the last turn)
      A_k     = delta_k + gamma * lam * A_{k+1}
      R_k     = A_k + V_k                          (every token of turn k gets A_k and R_k)

  then whitening as above. ``reinforce_pp`` has no groups: ``root`` only. Preflight refuses a layer
  an estimator does not implement (its traits' ``group_layers``).

Metrics (plain floats): ``adv_mean``, ``adv_std``, ``adv_max``, ``adv_min`` over valid tokens (loss_mask 1,
non-failed), ``failed_frac`` (samples), and for outcome estimators ``zero_std_group_frac``: the fraction
of groups (with at least one valid member) whose rewards are all equal, i.e. that teach nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import Tensor

from unirl.contracts import EstimatorTraits
from unirl.kernel.errors import ConfigError
from unirl.samples import Sample, groups

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import AlgorithmSection

__all__ = ["AdvantageResult", "dr_grpo", "gae", "group_layers", "grpo", "reinforce_pp", "reinforce_pp_baseline",
           "rloo"]


@dataclass
class AdvantageResult:
    """One fp32 1-D tensor per sample (len = len(response_ids)), in input order."""

    advantages: list[Tensor]
    returns: list[Tensor] | None = None  # value targets; gae only
    metrics: dict[str, float] = field(default_factory=dict)


# ----------------------------------------------------------------------------- options + traits
class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NoOptions(_Options):
    """An estimator without options: any key is an error."""


class GRPOOptions(_Options):
    scope: Literal["group", "batch"] = Field("group", description="std over each group, or over the batch")
    std: Literal["unbiased", "biased"] = Field("unbiased", description="Bessel-corrected (torch.std) or /n")
    eps: float = Field(1e-6, ge=0, description="added to the std")
    baseline: Literal["mean", "loo"] = Field("mean", description="group mean, or leave-one-out mean")


class GAEOptions(_Options):
    whiten: bool = Field(True, description="normalise advantages over the batch's masked-in tokens")


def estimator(*, needs_groups: bool = False, needs_values: bool = False, min_n: int = 1,
              options: type[BaseModel] = NoOptions) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare an estimator's :class:`~unirl.contracts.EstimatorTraits` (``fn.traits``) and its
    options model (``fn.Config = options``, the one every component declares). Preflight validates
    ``algorithm.estimator_options`` against it and checks ``min_n`` and ``needs_values`` before
    anything is built; the trainer reads the traits, never the name."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.traits = EstimatorTraits(needs_groups=needs_groups, needs_values=needs_values, min_n=min_n)
        fn.Config = options
        return fn

    return mark


#: every layer an outcome (group-baseline) estimator can group by
ALL_LAYERS = ("root", "turn", "fork")


def group_layers(*layers: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare the ``algorithm.group_layer`` values an estimator implements (above ``@estimator``)."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.traits = replace(fn.traits, group_layers=tuple(layers))
        return fn

    return mark


def _layer(algorithm: AlgorithmSection, fn: Callable[..., Any]) -> str:
    """``algorithm.group_layer``, refused when ``fn`` does not implement it (preflight refuses it first)."""
    layer = algorithm.group_layer
    allowed = fn.traits.group_layers
    if layer not in allowed:
        raise ConfigError(f"algorithm.group_layer: estimator '{fn.__name__}' cannot group by '{layer}'; "
                          f"set it to one of: {', '.join(allowed)}")
    return layer


def _options(options: BaseModel | dict[str, Any] | None, model: type[BaseModel]) -> Any:
    """``options`` as ``model``: the run's validated instance as it is; a raw dict (a direct call) is
    validated here, with the same field names the kernel reports."""
    if isinstance(options, model):
        return options
    try:
        return model.model_validate(dict(options or {}))
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(["algorithm.estimator_options", *map(str, err["loc"])])
        raise ConfigError(f"{field}: {err['msg']} (known: {', '.join(model.model_fields) or 'none'})") from None


def _rewards(samples: Sequence[Sample]) -> list[float]:
    """Rewards as floats, NaN for failed samples; a non-finite reward on a live sample is an error."""
    out = []
    for s in samples:
        if s.failed:
            out.append(math.nan)
            continue
        r = float(s.reward)
        if not math.isfinite(r):
            raise ValueError(f"sample {s.id}: reward {r} is not finite (mark the sample failed instead)")
        out.append(r)
    return out


def _std(x: Tensor, unbiased: bool) -> float:
    n = x.numel()
    if n < 2:
        return 0.0
    return float(x.std(correction=1 if unbiased else 0))


def _metrics(advs: list[Tensor], masks: list[Tensor], n_failed: int, n: int) -> dict[str, float]:
    vals = [a[m] for a, m in zip(advs, masks, strict=True)]
    flat = torch.cat(vals) if vals else torch.zeros(0)
    out = {"failed_frac": n_failed / n if n else 0.0}
    if flat.numel():
        out.update(
            adv_mean=float(flat.mean()),
            adv_std=float(flat.std(correction=0)),
            adv_max=float(flat.max()),
            adv_min=float(flat.min()),
        )
    else:
        out.update(adv_mean=0.0, adv_std=0.0, adv_max=0.0, adv_min=0.0)
    return out


def _valid_masks(samples: Sequence[Sample]) -> list[Tensor]:
    """Per-token bool: loss_mask == 1 and the sample did not fail."""
    out = []
    for s in samples:
        n = len(s.response_ids)
        if s.failed:
            out.append(torch.zeros(n, dtype=torch.bool))
        elif s.loss_mask:
            if len(s.loss_mask) != n:
                raise ValueError(f"sample {s.id}: loss_mask has {len(s.loss_mask)} entries for {n} tokens")
            out.append(torch.tensor(s.loss_mask, dtype=torch.long) > 0)
        else:  # no mask recorded: every response token is the policy's
            out.append(torch.ones(n, dtype=torch.bool))
    return out


def _units(samples: Sequence[Sample], layer: str) -> list[tuple[int, int, int, Any]]:
    """``(sample index, start, end, group key)``: the response range each group statistic covers."""
    out: list[tuple[int, int, int, Any]] = []
    for i, s in enumerate(samples):
        if layer == "fork":
            out.append((i, 0, len(s.response_ids), s.fork_group_id))
        elif layer == "turn":
            out += [(i, t.start, t.end, (s.group_id, t.index)) for t in s.turn_list()]
        else:
            out.append((i, 0, len(s.response_ids), s.group_id))
    return out


def _outcome_layered(samples: Sequence[Sample], per_group, layer: str) -> AdvantageResult:
    """``_outcome`` over the groups of ``layer`` (``turn``, ``fork``; see "Group layers")."""
    rewards = _rewards(samples)
    units = _units(samples, layer)
    by_key: dict[Any, list[int]] = {}
    for u, unit in enumerate(units):
        by_key.setdefault(unit[3], []).append(u)
    scalar = [0.0] * len(units)
    live_groups = zero_std = 0
    for members in by_key.values():
        live = [u for u in members if not math.isnan(rewards[units[u][0]])]
        if not live:
            continue
        live_groups += 1
        r = torch.tensor([rewards[units[u][0]] for u in live], dtype=torch.float64)
        if bool((r == r[0]).all()):
            zero_std += 1
        if len(live) < 2:
            continue
        for u, a in zip(live, per_group(r).tolist(), strict=True):
            scalar[u] = a
    advs = [torch.zeros(len(s.response_ids), dtype=torch.float32) for s in samples]
    for (i, start, end, _), a in zip(units, scalar, strict=True):
        advs[i][start:end] = a
    n_failed = sum(math.isnan(r) for r in rewards)
    metrics = _metrics(advs, _valid_masks(samples), n_failed, len(samples))
    metrics["zero_std_group_frac"] = zero_std / live_groups if live_groups else 0.0
    return AdvantageResult(advantages=advs, returns=None, metrics=metrics)


def _outcome(samples: Sequence[Sample], per_group, layer: str = "root") -> AdvantageResult:
    """Shared driver for outcome estimators: ``per_group(rewards [k] fp64) -> advantages [k]``."""
    if layer != "root":
        return _outcome_layered(samples, per_group, layer)
    rewards = _rewards(samples)
    index = {id(s): i for i, s in enumerate(samples)}
    scalar = [0.0] * len(samples)
    live_groups = zero_std = 0
    for members in groups(samples).values():
        idx = [index[id(s)] for s in members]
        live = [i for i in idx if not math.isnan(rewards[i])]
        if not live:
            continue
        live_groups += 1
        r = torch.tensor([rewards[i] for i in live], dtype=torch.float64)
        if bool((r == r[0]).all()):
            zero_std += 1
        if len(live) < 2:
            continue  # no baseline: advantage 0
        adv = per_group(r)
        for i, a in zip(live, adv.tolist(), strict=True):
            scalar[i] = a
    advs = [torch.full((len(s.response_ids),), a, dtype=torch.float32) for s, a in zip(samples, scalar, strict=True)]
    n_failed = sum(math.isnan(r) for r in rewards)
    metrics = _metrics(advs, _valid_masks(samples), n_failed, len(samples))
    metrics["zero_std_group_frac"] = zero_std / live_groups if live_groups else 0.0
    return AdvantageResult(advantages=advs, returns=None, metrics=metrics)


def mean_centred(r: Tensor) -> Tensor:
    """Reward minus the group mean: the baseline of Dr. GRPO, GRPO and REINFORCE++-baseline."""
    return r - r.mean()


def leave_one_out(r: Tensor) -> Tensor:
    """Reward minus the mean of the *other* members (RLOO; GRPO ``baseline: loo``). Needs ``len(r) >= 2``."""
    return r - (r.sum() - r) / (r.numel() - 1)


# ----------------------------------------------------------------------------- estimators
@group_layers(*ALL_LAYERS)
@estimator(needs_groups=True, min_n=2, options=GRPOOptions)
def grpo(
    samples: list[Sample],
    *,
    options: BaseModel | dict | None,
    algorithm: AlgorithmSection,
    values: list[Tensor] | None = None,
) -> AdvantageResult:
    """GRPO: group-mean baseline, divided by the group's (or the batch's) reward std. See module doc."""
    opts = _options(options, GRPOOptions)
    layer = _layer(algorithm, grpo)
    unbiased = opts.std == "unbiased"
    eps = float(opts.eps)

    centred = mean_centred if opts.baseline == "mean" else leave_one_out

    if opts.scope == "batch":
        live = [r for r in _rewards(samples) if not math.isnan(r)]
        batch_std = _std(torch.tensor(live, dtype=torch.float64), unbiased)
        return _outcome(samples, lambda r: centred(r) / (batch_std + eps), layer)
    return _outcome(samples, lambda r: centred(r) / (_std(r, unbiased) + eps), layer)


@group_layers(*ALL_LAYERS)
@estimator(needs_groups=True, min_n=2)
def dr_grpo(
    samples: list[Sample],
    *,
    options: BaseModel | dict | None,
    algorithm: AlgorithmSection,
    values: list[Tensor] | None = None,
) -> AdvantageResult:
    """Dr. GRPO: reward minus the group mean, no std division. See module doc."""
    _options(options, NoOptions)
    return _outcome(samples, mean_centred, _layer(algorithm, dr_grpo))


@group_layers(*ALL_LAYERS)
@estimator(needs_groups=True, min_n=2)
def rloo(
    samples: list[Sample],
    *,
    options: BaseModel | dict | None,
    algorithm: AlgorithmSection,
    values: list[Tensor] | None = None,
) -> AdvantageResult:
    """RLOO: reward minus the mean of the other valid members of the group. See module doc."""
    _options(options, NoOptions)
    return _outcome(samples, leave_one_out, _layer(algorithm, rloo))


def _whiten_tokens(samples: Sequence[Sample], res: AdvantageResult) -> AdvantageResult:
    """Normalise ``res``'s advantages over the valid tokens of the whole batch (verl's masked_whiten)."""
    valid = _valid_masks(samples)
    advs = [a.to(torch.float64) for a in res.advantages]
    flat = torch.cat([a[m] for a, m in zip(advs, valid, strict=True)]) if advs else torch.zeros(0)
    if flat.numel() >= 2:
        mean, scale = flat.mean(), torch.rsqrt(flat.var(correction=1) + 1e-8)
        advs = [(a - mean) * scale for a in advs]
    advs = [torch.where(m, a, 0.0).to(torch.float32) for a, m in zip(advs, valid, strict=True)]
    n_failed = sum(s.failed for s in samples)
    metrics = {**res.metrics, **_metrics(advs, valid, n_failed, len(samples))}
    return AdvantageResult(advantages=advs, returns=None, metrics=metrics)


@estimator()
def reinforce_pp(
    samples: list[Sample],
    *,
    options: BaseModel | dict | None,
    algorithm: AlgorithmSection,
    values: list[Tensor] | None = None,
) -> AdvantageResult:
    """REINFORCE++: the outcome reward normalised over the batch's valid tokens. See module doc."""
    _options(options, NoOptions)
    _layer(algorithm, reinforce_pp)
    rewards = _rewards(samples)
    advs = [torch.full((len(s.response_ids),), 0.0 if math.isnan(r) else r, dtype=torch.float64)
            for s, r in zip(samples, rewards, strict=True)]
    return _whiten_tokens(samples, AdvantageResult(advantages=advs))


@group_layers(*ALL_LAYERS)
@estimator(needs_groups=True, min_n=2)
def reinforce_pp_baseline(
    samples: list[Sample],
    *,
    options: BaseModel | dict | None,
    algorithm: AlgorithmSection,
    values: list[Tensor] | None = None,
) -> AdvantageResult:
    """REINFORCE++-baseline: group mean subtracted, then normalised over the batch. See module doc."""
    _options(options, NoOptions)
    return _whiten_tokens(samples, _outcome(samples, mean_centred, _layer(algorithm, reinforce_pp_baseline)))


def _gae_turns(s: Sample, v: Tensor, reward: float, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Turn-level GAE of one trajectory (see "Group layers"): per-token (advantages, returns)."""
    adv, ret = torch.zeros_like(v), v.clone()
    turns = [t for t in s.turn_list() if t.end > t.start]
    a_next = v_next = 0.0
    for j in range(len(turns) - 1, -1, -1):
        t = turns[j]
        v_k = float(v[t.start])
        r_k = reward if j == len(turns) - 1 else 0.0
        a_k = r_k + gamma * v_next - v_k + gamma * lam * a_next
        adv[t.start:t.end] = a_k
        ret[t.start:t.end] = a_k + v_k
        a_next, v_next = a_k, v_k
    return adv, ret


@group_layers("root", "turn")
@estimator(needs_values=True, options=GAEOptions)
def gae(
    samples: list[Sample],
    *,
    options: BaseModel | dict | None,
    algorithm: AlgorithmSection,
    values: list[Tensor] | None = None,
) -> AdvantageResult:
    """GAE(gamma, lam) with a terminal reward, per trajectory; optional batch whitening. See module doc."""
    opts = _options(options, GAEOptions)
    layer = _layer(algorithm, gae)
    if values is None:
        raise ValueError("gae needs per-token value estimates (set actor.value_head: true)")
    if len(values) != len(samples):
        raise ValueError(f"gae: {len(values)} value tensors for {len(samples)} samples")
    gamma, lam = float(algorithm.gamma), float(algorithm.lam)
    rewards = _rewards(samples)
    lens = [len(s.response_ids) for s in samples]
    vals = []
    for s, v, n in zip(samples, values, lens, strict=True):
        v = v.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
        if v.numel() != n:
            raise ValueError(f"gae: sample {s.id} has {n} response tokens but {v.numel()} values")
        vals.append(v)

    # Vectorised over the batch, looping over time: right-pad with V = 0, r = 0, so that the padding
    # produces delta = 0 and A = 0, and V_{T} = 0 after each trajectory's last token.
    B, T = len(samples), max(lens, default=0)
    V = torch.zeros(B, T + 1, dtype=torch.float64)
    R = torch.zeros(B, T, dtype=torch.float64)
    for i, (v, n) in enumerate(zip(vals, lens, strict=True)):
        V[i, :n] = v
        if n and not math.isnan(rewards[i]):
            R[i, n - 1] = rewards[i]
    delta = R + gamma * V[:, 1:] - V[:, :-1]
    A = torch.zeros(B, T + 1, dtype=torch.float64)
    for t in range(T - 1, -1, -1):
        A[:, t] = delta[:, t] + gamma * lam * A[:, t + 1]
    A = A[:, :T]
    Ret = A + V[:, :T]

    valid = _valid_masks(samples)
    advs, rets = [], []
    for i, n in enumerate(lens):
        if math.isnan(rewards[i]):
            advs.append(torch.zeros(n, dtype=torch.float64))
            rets.append(vals[i].clone())
        elif layer == "turn":
            a, r = _gae_turns(samples[i], vals[i], rewards[i], gamma, lam)
            advs.append(a)
            rets.append(r)
        else:
            advs.append(A[i, :n].clone())
            rets.append(Ret[i, :n].clone())

    if opts.whiten:
        flat = torch.cat([a[m] for a, m in zip(advs, valid, strict=True)]) if advs else torch.zeros(0)
        if flat.numel() >= 2:
            mean = flat.mean()
            scale = torch.rsqrt(flat.var(correction=1) + 1e-8)
        elif flat.numel() == 1:
            mean, scale = flat.mean(), torch.tensor(1.0, dtype=torch.float64)
        else:
            mean, scale = torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
        advs = [(a - mean) * scale for a in advs]
    advs = [torch.where(m, a, 0.0).to(torch.float32) for a, m in zip(advs, valid, strict=True)]
    rets = [r.to(torch.float32) for r in rets]
    n_failed = sum(math.isnan(r) for r in rewards)
    return AdvantageResult(advantages=advs, returns=rets, metrics=_metrics(advs, valid, n_failed, len(samples)))
