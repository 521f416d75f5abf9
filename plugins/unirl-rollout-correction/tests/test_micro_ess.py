"""Micro-local ESS (``rc/ess_frac_micro``) against hand-computed numbers, and how it differs from the
global ESS (``rc/ess_frac_global``)."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.api import RunConfig, Sample
from unirl_rollout_correction.correction import micro_partition, rollout_correction


def sample(i: int, n: int, mask: list[int] | None = None) -> Sample:
    return Sample(id=f"p{i}@t/0", prompt_ids=[5, 6], response_ids=[7] * n, loss_mask=mask or [1] * n,
                  status="ok", reward=0.0)


def run(ratios: list[list[float]], masks: list[list[int]] | None, *, micro: int, updates: int = 1, cap: float = 4.0):
    """The modifier on responses whose token ratios pi_old / mu are ``ratios`` (token_tis, cap ``cap``)."""
    masks = masks or [[1] * len(r) for r in ratios]
    samples = [sample(i, len(r), m) for i, (r, m) in enumerate(zip(ratios, masks, strict=True))]
    old = [torch.tensor([-1.0] * len(r), dtype=torch.float64) for r in ratios]
    roll = [o - torch.log(torch.tensor(r, dtype=torch.float64)) for o, r in zip(old, ratios, strict=True)]
    config = RunConfig.model_validate({
        "actor": {"micro_batch_size": micro}, "algorithm": {"modifiers": ["rollout_correction"],
                                                            "updates_per_batch": updates},
        "plugins": {"rollout_correction": {"mode": "token_tis", "threshold": cap}}})
    batch = {"old_logprobs": old, "rollout_logprobs": roll, "advantages": [torch.zeros(len(r)) for r in ratios]}
    return rollout_correction(samples, batch, config)


def test_hand_computed_micro_and_global_ess():
    # micro-batch A: weights 1, 2            -> (1 + 2)^2 / (2 * (1 + 4))            = 9 / 10
    # micro-batch B: weights 0.5, 0.5, 1 (+ one masked token with a wild ratio, which takes no part)
    #                                         -> (0.5 + 0.5 + 1)^2 / (3 * (0.25 + 0.25 + 1)) = 4 / 4.5 = 8 / 9
    # micro (mean over micro-batches)        = (9/10 + 8/9) / 2 = 161 / 180;  min = 8 / 9
    # global (all five active tokens pooled) = 5^2 / (5 * 6.5) = 10 / 13
    m = run([[1.0, 2.0], [0.5, 0.5, 1.0, 50.0]], [[1, 1], [1, 1, 1, 0]], micro=1)
    assert m["rc/ess_frac_micro"] == pytest.approx(161 / 180, abs=1e-12)
    assert m["rc/ess_frac_micro_min"] == pytest.approx(8 / 9, abs=1e-12)
    assert m["rc/ess_frac_global"] == pytest.approx(10 / 13, abs=1e-12)
    assert m["rc/micro_batches"] == 2.0


def test_uniform_within_micro_batches_hides_the_spread_between_them():
    # the docs' worked example: weights all 2 in one micro-batch, all 0.5 in the other
    m = run([[2.0, 2.0], [0.5, 0.5]], None, micro=1)
    assert m["rc/ess_frac_micro"] == pytest.approx(1.0, abs=1e-12)  # each micro-batch looks perfect
    assert m["rc/ess_frac_global"] == pytest.approx(25 / 34, abs=1e-12)  # pooled: 0.735
    # one micro-batch holding the whole batch: micro == global
    whole = run([[2.0, 2.0], [0.5, 0.5]], None, micro=8)
    assert whole["rc/ess_frac_micro"] == pytest.approx(whole["rc/ess_frac_global"], abs=1e-15)
    assert whole["rc/micro_batches"] == 1.0


def test_micro_batches_follow_the_update_split():
    # updates_per_batch 2 on 3 samples: mini-batches {0, 1} and {2}; micro_batch_size 8 keeps each whole
    m = run([[2.0, 2.0], [0.5, 0.5], [1.0, 3.0]], None, micro=8, updates=2)
    a = (2 + 2 + 0.5 + 0.5) ** 2 / (4 * (4 + 4 + 0.25 + 0.25))
    b = (1 + 3) ** 2 / (2 * (1 + 9))
    assert m["rc/micro_batches"] == 2.0
    assert m["rc/ess_frac_micro"] == pytest.approx((a + b) / 2, abs=1e-12)
    assert m["rc/ess_frac_micro_min"] == pytest.approx(min(a, b), abs=1e-12)


def test_partition_sizes_are_the_actors():
    assert micro_partition(10, 2, 3) == [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9]]
    assert micro_partition(5, 1, 64) == [[0, 1, 2, 3, 4]]
    assert micro_partition(0, 4, 8) == []
    for n, u, k in [(256, 4, 128), (17, 3, 4), (7, 8, 2)]:
        parts = micro_partition(n, u, k)
        assert sorted(i for p in parts for i in p) == list(range(n)) and max(map(len, parts)) <= k
        assert len(parts) >= math.ceil(n / math.ceil(n / u) if n else 0)


def test_all_masked_reads_neutral():
    m = run([[2.0], [0.5]], [[0], [0]], micro=1)
    assert m["rc/ess_frac_micro"] == 1.0 and m["rc/ess_frac_micro_min"] == 1.0 and m["rc/micro_batches"] == 0.0
