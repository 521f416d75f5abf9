r"""Sampling-side algorithm pieces: what happens to a rollout batch between scoring and the estimator.

Mechanisms only; the trainer decides when each runs (:func:`unirl.trainer.drivers.collect_batch`,
:func:`unirl.trainer.step.train_on_batch`).

**Dynamic sampling** (DAPO, Yu et al. 2025, *DAPO: An Open-Source LLM Reinforcement Learning System at
Scale*, arXiv:2503.14476, §3.2): a group whose valid rewards are all equal (all right or all wrong) has
zero advantage under any group-baseline estimator and only dilutes the batch. :func:`fill_groups` drops
such groups and draws more prompts until ``target`` informative groups are collected or ``max_draws``
rollout rounds (the first included) have run; a full batch is cut to exactly ``target`` groups (in draw
order). When the bound is hit first the step trains on the informative groups it has; when there are
none at all it falls back to the groups of the first round (their advantages are 0: the step only
moves the KL term). The filter looks at the task reward as scored (before any shaping below).
Groups are judged at the estimator's layer (``algorithm.group_layer``, :func:`layer_groups`): under
``fork`` a launch whose forks all agree within themselves has zero advantage everywhere even when its
forks disagree with each other, so it is dropped; whole launches are kept or dropped (a launch is the
unit the trainer shards and the controller refills).

**Overlong reward shaping** (DAPO §3.4, "soft overlong punishment"), with ``L_max`` the generation
budget (``rollout.max_new_tokens``) and ``L_cache`` the buffer (``algorithm.overlong.buffer_tokens``)::

    R_length(y) = 0                                   if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                = -1                                  if |y| > L_max

times ``algorithm.overlong.penalty``, added to the reward. ``|y|`` is the number of response tokens
(single-turn: the generated tokens). Failed samples are left alone.

**KL in reward** (``algorithm.kl_form: reward``; Ouyang et al. 2022, InstructGPT; Ziegler et al.
2019): instead of adding ``kl_coef * KL`` to the loss, the per-token estimate ``kl_t`` of
KL(pi_old || pi_ref) on the sampled tokens is subtracted from the reward before the estimator. With an
outcome reward and an outcome estimator this is ``r_i <- r_i - kl_coef * sum_{t, mask=1} kl_t`` (what
verl's ``apply_kl_penalty`` + ``token_level_rewards.sum(-1)`` gives for GRPO / RLOO / REINFORCE++). For
``gae`` the whole penalty is placed on the terminal token (with the default gamma = 1 the returns at the
first token equal the per-token form; the per-token advantages differ).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from unirl.samples import Sample, groups

__all__ = ["FillResult", "apply_kl_in_reward", "apply_overlong_penalty", "fill_groups", "informative",
           "informative_at", "layer_groups", "overlong_penalty"]


def informative(members: Sequence[Sample]) -> bool:
    """A group teaches something: at least two valid (non-failed) members whose rewards differ."""
    rewards = [float(s.reward) for s in members if not s.failed and not math.isnan(float(s.reward))]
    return len(rewards) >= 2 and any(r != rewards[0] for r in rewards)


def layer_groups(members: Sequence[Sample], layer: str = "root") -> list[list[Sample]]:
    """The groups of ``layer`` inside one launch (``members``: one ``Sample.group_id``), as the outcome
    estimators form them: ``root`` the launch itself; ``fork`` the branches of each fork point
    (``Sample.fork_group_id``); ``turn`` for each turn index, the members that reached that turn."""
    if layer == "root":
        return [list(members)]
    if layer == "fork":
        by: dict[str, list[Sample]] = {}
        for s in members:
            by.setdefault(s.fork_group_id, []).append(s)
        return list(by.values())
    if layer == "turn":
        depth = max((len(s.turn_list()) for s in members), default=0)
        return [[s for s in members if len(s.turn_list()) > t] for t in range(depth)]
    raise ValueError(f"unknown group layer {layer!r} (root, turn, fork)")


def informative_at(members: Sequence[Sample], layer: str = "root") -> bool:
    """Some group of ``layer`` inside the launch ``members`` is :func:`informative`."""
    return any(informative(g) for g in layer_groups(members, layer))


@dataclass
class FillResult:
    samples: list[Sample]
    draws: int  # rollout rounds run (the first included)
    metrics: dict[str, float] = field(default_factory=dict)


def fill_groups(draw: Callable[[int], list[Sample]], *, target: int, max_draws: int,
                layer: str = "root") -> FillResult:
    """DAPO dynamic sampling (see module doc). ``draw(k)`` rolls out and scores round ``k`` (0-based)
    and returns its samples; groups are ``Sample.group_id`` (unique per launch, so rounds never merge),
    judged at ``layer`` (:func:`informative_at`).

    Metrics: ``ds_draws`` (rounds run), ``ds_groups_drawn``, ``ds_groups_kept`` (informative, before the
    cut), ``ds_kept_frac`` (kept / drawn) and ``ds_batch_groups`` (groups trained on; ``target`` unless
    the bound was hit)."""
    if target < 1 or max_draws < 1:
        raise ValueError(f"fill_groups: target {target} and max_draws {max_draws} must be >= 1")
    kept: list[list[Sample]] = []
    first: list[list[Sample]] = []
    drawn = draws = 0
    while draws < max_draws and len(kept) < target:
        round_groups = list(groups(draw(draws)).values())
        if draws == 0:
            first = round_groups
        draws += 1
        drawn += len(round_groups)
        kept += [g for g in round_groups if informative_at(g, layer)]
    n_kept = len(kept)
    chosen = kept[:target] if kept else first
    metrics = {
        "ds_draws": float(draws),
        "ds_groups_drawn": float(drawn),
        "ds_groups_kept": float(n_kept),
        "ds_kept_frac": n_kept / drawn if drawn else 0.0,
        "ds_batch_groups": float(len(chosen)),
    }
    return FillResult(samples=[s for g in chosen for s in g], draws=draws, metrics=metrics)


def overlong_penalty(length: int, *, max_len: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment ``R_length`` (<= 0) of a response of ``length`` tokens."""
    expected = max_len - buffer
    if length <= expected:
        return 0.0
    if length > max_len:
        return -penalty
    return penalty * (expected - length) / buffer


def apply_overlong_penalty(samples: Sequence[Sample], *, max_len: int, buffer: int,
                           penalty: float) -> dict[str, float]:
    """Add :func:`overlong_penalty` to every non-failed sample's reward, in place. Metrics:
    ``overlong_frac`` (samples penalised) and ``overlong_penalty`` (mean penalty over live samples)."""
    live = [s for s in samples if not s.failed]
    total = hit = 0
    for s in live:
        p = overlong_penalty(len(s.response_ids), max_len=max_len, buffer=buffer, penalty=penalty)
        s.reward = float(s.reward) + p
        total += p
        hit += p < 0
    n = max(len(live), 1)
    return {"overlong_frac": hit / n, "overlong_penalty": total / n}


def apply_kl_in_reward(samples: Sequence[Sample], old_logprobs: Sequence[Tensor], ref_logprobs: Sequence[Tensor],
                       *, kl_coef: float, estimator: str, clamp: float | None) -> dict[str, float]:
    """Subtract ``kl_coef * sum_t kl_t`` (masked-in tokens) from every non-failed sample's reward, in
    place (see module doc). Metrics: ``kl_reward`` (mean per-token KL estimate over masked-in tokens)
    and ``kl_reward_penalty`` (mean penalty per live sample)."""
    from unirl.algorithms.losses import kl_penalty

    tokens = kl_sum = pen_sum = 0.0
    live = 0
    for s, old, ref in zip(samples, old_logprobs, ref_logprobs, strict=True):
        if s.failed:
            continue
        mask = torch.tensor(s.loss_mask or [1] * len(s.response_ids), dtype=torch.bool)
        kl = kl_penalty(old.detach().double().cpu(), ref.detach().double().cpu(), estimator, clamp)
        kl = torch.where(mask, kl, torch.zeros_like(kl))
        penalty = kl_coef * float(kl.sum())
        s.reward = float(s.reward) - penalty
        tokens += float(mask.sum())
        kl_sum += float(kl.sum())
        pen_sum += penalty
        live += 1
    return {"kl_reward": kl_sum / tokens if tokens else 0.0, "kl_reward_penalty": pen_sum / live if live else 0.0}
