"""Losses against hand-derived values and gradients, micro-batch additivity and mask safety."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.algorithms.losses import (
    AGGREGATIONS,
    METRIC_REDUCE,
    LossInputs,
    LossSettings,
    entropy_from_logits,
    kl_penalty,
    ppo_clip,
    value_loss,
)

F64 = torch.float64


def hand_case():
    """Eight tokens in three sequences, one per clipping situation (clip_low 0.2, clip_high 0.28)."""
    ratio = torch.tensor([1.10, 1.25, 1.40, 0.70, 0.78, 1.50, 0.50, 3.00], dtype=F64)
    adv = torch.tensor([1.0, 2.0, 1.0, -1.0, -0.5, -1.0, 1.0, -2.0], dtype=F64)
    #  t0 inside | t1 inside only thanks to clip-higher | t2 r>1+ch, A>0: clipped | t3, t4 r<1-cl, A<0:
    #  clipped | t5 r>1+ch, A<0: unclipped (pessimistic) | t6 r<1-cl, A>0: unclipped | t7 masked out
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0], dtype=F64)
    seq_index = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    seq_lens = torch.tensor([3, 2, 2])
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5, -0.2, -2.5, -1.0], dtype=F64)
    weights = torch.tensor([1.0, 0.5, 2.0, 1.5, 0.7, 0.9, 1.3, 4.0], dtype=F64)
    return ratio, adv, mask, seq_index, seq_lens, old, weights


TOTAL_TOKENS, TOTAL_SEQS, NORM_LEN = 10.0, 5.0, 8.0  # global denominators (bigger than this micro-batch)


def denominators(agg: str, seq_index: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    if agg == "token-mean":
        return torch.full(seq_index.shape, TOTAL_TOKENS, dtype=F64)
    if agg == "seq-mean-token-mean":
        return seq_lens[seq_index].to(F64).clamp(min=1) * TOTAL_SEQS
    if agg == "seq-mean-token-sum":
        return torch.full(seq_index.shape, TOTAL_SEQS, dtype=F64)
    return torch.full(seq_index.shape, NORM_LEN * TOTAL_SEQS, dtype=F64)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("clip", [(0.2, 0.28), (0.2, 0.2), (0.1, 0.45)])
@pytest.mark.parametrize("weighted", [False, True])
def test_ppo_clip_gradient_matches_hand_derivation(agg, clip, weighted):
    clip_low, clip_high = clip
    ratio, adv, mask, seq_index, seq_lens, old, weights = hand_case()
    w = weights if weighted else torch.ones_like(weights)
    logp = (old + torch.log(ratio)).clone().requires_grad_(True)
    loss, metrics = ppo_clip(
        LossInputs(logp, old, adv, mask, seq_index, seq_lens, total_tokens=TOTAL_TOKENS, total_seqs=TOTAL_SEQS,
                   token_weights=weights if weighted else None),
        LossSettings(clip_low=clip_low, clip_high=clip_high, agg=agg, norm_len=NORM_LEN),
    )
    loss.backward()

    # d/dlogp_t of -min(r A, clip(r) A) is -A r where the unclipped branch is the min, 0 where the
    # clipped branch is (A > 0 and r > 1 + clip_high, or A < 0 and r < 1 - clip_low).
    clipped = ((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & (ratio < 1 - clip_low))
    D = denominators(agg, seq_index, seq_lens)
    expected_grad = torch.where(clipped, 0.0, -adv * ratio) * w * mask / D
    assert torch.allclose(logp.grad, expected_grad, atol=1e-6, rtol=0), (logp.grad, expected_grad)

    surrogate = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    expected_loss = (surrogate * w * mask / D).sum()
    assert torch.allclose(loss.detach(), expected_loss, atol=1e-9)
    assert loss.dtype == F64
    assert metrics["clip_frac"] == pytest.approx(float((clipped & (mask > 0)).sum()) / TOTAL_TOKENS)
    assert metrics["ratio_max"] == pytest.approx(1.5)  # the masked token's ratio 3.0 is not counted
    assert all(not m.requires_grad for m in metrics.values())


def test_clip_higher_case_by_hand():
    # the t1 token (ratio 1.25, A = 2): gradient -2 * 1.25 / 10 with clip_high 0.28, 0 with 0.2
    ratio, adv, mask, seq_index, seq_lens, old, _ = hand_case()
    for clip_high, expected in [(0.28, -0.25), (0.2, 0.0)]:
        logp = (old + torch.log(ratio)).requires_grad_(True)
        loss, _ = ppo_clip(LossInputs(logp, old, adv, mask, seq_index, seq_lens, total_tokens=10.0, total_seqs=1.0),
                           LossSettings(clip_low=0.2, clip_high=clip_high, agg="token-mean", norm_len=1.0))
        loss.backward()
        assert float(logp.grad[1]) == pytest.approx(expected, abs=1e-12)
        assert float(logp.grad[2]) == 0.0 and float(logp.grad[3]) == 0.0 and float(logp.grad[4]) == 0.0
        assert float(logp.grad[5]) == pytest.approx(1.5 / 10) and float(logp.grad[6]) == pytest.approx(-0.5 / 10)


def random_batch(seed: int, lens=(3, 0, 5, 1, 4, 2, 6, 3)):
    g = torch.Generator().manual_seed(seed)
    N = sum(lens)
    seq_index = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    mask = (torch.rand(N, generator=g) > 0.25).to(F64)
    mask[seq_index == 3] = 0  # one fully masked sequence
    old = -torch.rand(N, generator=g, dtype=F64) * 3
    logp = old + 0.4 * torch.randn(N, generator=g, dtype=F64)
    adv = torch.randn(N, generator=g, dtype=F64)
    ref = old + 0.3 * torch.randn(N, generator=g, dtype=F64)
    w = torch.rand(N, generator=g, dtype=F64) * 2
    return dict(lens=list(lens), seq_index=seq_index, mask=mask, old=old, logp=logp, adv=adv, ref=ref, w=w)


def seq_lens_of(mask, seq_index, S):
    return torch.zeros(S, dtype=torch.long).index_add(0, seq_index, (mask > 0).long())


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("parts", [2, 4])
def test_micro_batches_sum_to_the_full_batch(agg, parts):
    b = random_batch(0)
    S = len(b["lens"])
    full_lens = seq_lens_of(b["mask"], b["seq_index"], S)
    settings = LossSettings(clip_low=0.2, clip_high=0.28, agg=agg, norm_len=16.0, kl_coef=0.1, kl_estimator="k3")
    kw = dict(total_tokens=float(b["mask"].sum()), total_seqs=float((full_lens > 0).sum()))

    lp_full = b["logp"].clone().requires_grad_(True)
    full, full_m = ppo_clip(LossInputs(lp_full, b["old"], b["adv"], b["mask"], b["seq_index"], full_lens,
                                       ref_logprobs=b["ref"], token_weights=b["w"], **kw), settings)
    full.backward()

    lp = b["logp"].clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    sums = {k: torch.zeros((), dtype=F64) for k in full_m}
    seqs = torch.arange(S).chunk(parts)
    for chunk in seqs:
        sel = torch.isin(b["seq_index"], chunk)
        idx = sel.nonzero().squeeze(1)
        local_index = b["seq_index"][idx] - int(chunk[0])
        inp = LossInputs(lp[idx], b["old"][idx], b["adv"][idx], b["mask"][idx], local_index,
                         seq_lens_of(b["mask"][idx], local_index, len(chunk)), ref_logprobs=b["ref"][idx],
                         token_weights=b["w"][idx], **kw)
        loss, m = ppo_clip(inp, settings)
        loss.backward()
        total = total + loss.detach()
        for k, v in m.items():
            sums[k] = torch.maximum(sums[k], v) if METRIC_REDUCE[k] == "max" else sums[k] + v
    assert torch.allclose(total, full.detach(), atol=1e-12)
    assert torch.allclose(lp.grad, lp_full.grad, atol=1e-12)
    for k in full_m:
        assert torch.allclose(sums[k], full_m[k], atol=1e-12), k


def test_fully_masked_sequence_with_garbage_adds_nothing():
    b = random_batch(1, lens=(3, 4))
    S = 2
    lens = seq_lens_of(b["mask"], b["seq_index"], S)
    kw = dict(total_tokens=float(b["mask"].sum()), total_seqs=2.0)
    # append a third sequence: fully masked, with infinite / NaN values everywhere
    n_extra = 3
    logp2 = torch.cat([b["logp"], torch.full((n_extra,), -math.inf, dtype=F64)])
    old2 = torch.cat([b["old"], torch.full((n_extra,), math.nan, dtype=F64)])
    adv2 = torch.cat([b["adv"], torch.full((n_extra,), math.nan, dtype=F64)])
    ref2 = torch.cat([b["ref"], torch.full((n_extra,), math.inf, dtype=F64)])
    w2 = torch.cat([b["w"], torch.full((n_extra,), math.nan, dtype=F64)])
    mask2 = torch.cat([b["mask"], torch.zeros(n_extra, dtype=F64)])
    idx2 = torch.cat([b["seq_index"], torch.full((n_extra,), 2)])
    lens2 = torch.cat([lens, torch.zeros(1, dtype=torch.long)])
    for agg in AGGREGATIONS:
        settings = LossSettings(clip_low=0.2, clip_high=0.2, agg=agg, norm_len=8.0, kl_coef=0.5)
        lp = b["logp"].clone().requires_grad_(True)
        base, base_m = ppo_clip(LossInputs(lp, b["old"], b["adv"], b["mask"], b["seq_index"], lens,
                                           ref_logprobs=b["ref"], token_weights=b["w"], **kw), settings)
        base.backward()
        lp2 = logp2.clone().requires_grad_(True)
        loss, m = ppo_clip(LossInputs(lp2, old2, adv2, mask2, idx2, lens2, ref_logprobs=ref2, token_weights=w2, **kw),
                           settings)
        loss.backward()
        assert torch.isfinite(loss) and torch.allclose(loss, base, atol=1e-12)
        assert torch.isfinite(lp2.grad).all()
        assert torch.equal(lp2.grad[-n_extra:], torch.zeros(n_extra, dtype=F64))
        assert torch.allclose(lp2.grad[:-n_extra], lp.grad, atol=1e-12)
        for k in base_m:
            assert torch.isfinite(m[k]) and torch.allclose(m[k], base_m[k], atol=1e-12), k


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_empty_micro_batch_is_zero(agg):
    lp = torch.zeros(0, requires_grad=True)
    e = torch.zeros(0)
    inp = LossInputs(lp, e, e, e, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                     total_tokens=0.0, total_seqs=0.0, ref_logprobs=e)
    loss, metrics = ppo_clip(inp, LossSettings(clip_low=0.2, clip_high=0.2, agg=agg, norm_len=0.0, kl_coef=0.1))
    loss.backward()
    assert float(loss.detach()) == 0.0 and lp.grad.shape == (0,)
    assert all(math.isfinite(float(v)) for v in metrics.values())
    vl, vm = value_loss(torch.zeros(0, requires_grad=True), e, e, e, clip=0.2, total_tokens=0.0)
    assert float(vl.detach()) == 0.0 and all(math.isfinite(float(v)) for v in vm.values())


def test_all_masked_global_denominator_zero_gives_zero_not_nan():
    b = random_batch(2, lens=(2, 3))
    mask = torch.zeros_like(b["mask"])
    lp = b["logp"].clone().requires_grad_(True)
    for agg in AGGREGATIONS:
        loss, m = ppo_clip(LossInputs(lp, b["old"], b["adv"], mask, b["seq_index"], torch.zeros(2, dtype=torch.long),
                                      total_tokens=0.0, total_seqs=0.0),
                           LossSettings(clip_low=0.2, clip_high=0.2, agg=agg, norm_len=4.0))
        assert float(loss.detach()) == 0.0 and all(math.isfinite(float(v)) for v in m.values())


def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -2.0], dtype=F64)
    ref = torch.tensor([-1.5, -1.0], dtype=F64)
    # k1 = logp - ref; k3 = exp(s) - s - 1 with s = ref - logp = [-0.5, 1]
    assert torch.allclose(kl_penalty(logp, ref, "k1"), torch.tensor([0.5, -1.0], dtype=F64))
    assert torch.allclose(kl_penalty(logp, ref, "k3"), torch.tensor([0.10653065971263342, 0.7182818284590451],
                                                                    dtype=F64))
    assert torch.allclose(kl_penalty(logp, ref, "k2"), torch.tensor([0.125, 0.5], dtype=F64))
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k4")


@pytest.mark.parametrize("est", ["k1", "k3"])
def test_kl_term_in_ppo_clip(est):
    # advantages 0: the loss is kl_coef * token-mean(kl), gradient kl_coef * dkl/dlogp / total_tokens
    logp = torch.tensor([-1.0, -2.0, -0.3], dtype=F64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, 9.0], dtype=F64)
    mask = torch.tensor([1.0, 1.0, 0.0], dtype=F64)
    inp = LossInputs(logp, logp.detach(), torch.zeros(3, dtype=F64), mask, torch.zeros(3, dtype=torch.long),
                     torch.tensor([2]), total_tokens=2.0, total_seqs=1.0, ref_logprobs=ref)
    loss, m = ppo_clip(inp, LossSettings(clip_low=0.2, clip_high=0.2, agg="token-mean", norm_len=1.0, kl_coef=0.25,
                                         kl_estimator=est))
    loss.backward()
    if est == "k1":
        kl, dkl = [0.5, -1.0], [1.0, 1.0]
    else:  # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp)
        kl, dkl = [0.10653065971263342, 0.7182818284590451], [1 - math.exp(-0.5), 1 - math.e]
    assert float(loss.detach()) == pytest.approx(0.25 * sum(kl) / 2)
    assert float(m["kl"]) == pytest.approx(sum(kl) / 2)
    assert torch.allclose(logp.grad, torch.tensor([0.25 * dkl[0] / 2, 0.25 * dkl[1] / 2, 0.0], dtype=F64))
    # kl_coef 0 reports the metric but adds nothing to the loss
    loss0, m0 = ppo_clip(inp, LossSettings(clip_low=0.2, clip_high=0.2, agg="token-mean", norm_len=1.0, kl_coef=0.0,
                                           kl_estimator=est))
    assert float(loss0.detach()) == 0.0 and float(m0["kl"]) == pytest.approx(sum(kl) / 2)


def test_approx_kl_metric_by_hand():
    # approx_kl = sum over masked tokens of (r - 1 - log r) / total_tokens
    old = torch.tensor([-1.0, -1.0], dtype=F64)
    logp = old + torch.log(torch.tensor([2.0, 0.5], dtype=F64))
    inp = LossInputs(logp, old, torch.ones(2, dtype=F64), torch.ones(2, dtype=F64), torch.tensor([0, 0]),
                     torch.tensor([2]), total_tokens=4.0, total_seqs=1.0)
    _, m = ppo_clip(inp, LossSettings(clip_low=0.2, clip_high=0.2, agg="token-mean", norm_len=1.0))
    expected = ((2 - 1 - math.log(2)) + (0.5 - 1 - math.log(0.5))) / 4
    assert float(m["approx_kl"]) == pytest.approx(expected)


def test_value_loss_clipping_by_hand():
    # V_old = 1 (2 for the last), clip 0.2, returns R:
    #  V=1.5, R=2: max((-.5)^2=.25, (1.2-2)^2=.64) -> .32, clipped branch -> grad 0
    #  V=1.1, R=2: inside the clip, .81 -> .405, grad (V - R) = -0.9
    #  V=0.5, R=2: max(2.25, (0.8-2)^2=1.44) -> 1.125, unclipped, grad -1.5
    #  V=2.6, R=2.1, V_old=2: max(.25, (2.2-2.1)^2=.01) -> .125, unclipped, grad 0.5
    #  fifth token masked out
    v = torch.tensor([1.5, 1.1, 0.5, 2.6, 7.0], dtype=F64, requires_grad=True)
    old = torch.tensor([1.0, 1.0, 1.0, 2.0, 0.0], dtype=F64)
    ret = torch.tensor([2.0, 2.0, 2.0, 2.1, -3.0], dtype=F64)
    mask = torch.tensor([1, 1, 1, 1, 0], dtype=F64)
    loss, m = value_loss(v, old, ret, mask, clip=0.2, total_tokens=4.0)
    loss.backward()
    assert float(loss.detach()) == pytest.approx((0.32 + 0.405 + 1.125 + 0.125) / 4)
    assert torch.allclose(v.grad, torch.tensor([0.0, -0.9, -1.5, 0.5, 0.0], dtype=F64) / 4)
    assert float(m["vf_clip_frac"]) == pytest.approx(1 / 4)
    assert float(m["vf_error"]) == pytest.approx((0.25 + 0.81 + 2.25 + 0.25) / 4)
    # no clipping: plain 0.5 * (V - R)^2
    v.grad = None
    loss, _ = value_loss(v, old, ret, mask, clip=None, total_tokens=4.0)
    assert float(loss.detach()) == pytest.approx(0.5 * (0.25 + 0.81 + 2.25 + 0.25) / 4)
    # sequence aggregation: two sequences, seq-mean-token-mean
    loss, _ = value_loss(v, old, ret, mask, clip=0.2, total_tokens=4.0, agg="seq-mean-token-mean",
                         seq_index=torch.tensor([0, 0, 0, 1, 1]), seq_lens=torch.tensor([3, 1]), total_seqs=2.0)
    assert float(loss.detach()) == pytest.approx(((0.32 + 0.405 + 1.125) / 3 + 0.125) / 2)


def test_entropy_from_logits():
    assert torch.allclose(entropy_from_logits(torch.zeros(2, 4)), torch.full((2,), math.log(4)))
    x = torch.tensor([[0.0, 0.0, -math.inf], [1000.0, 1000.0, -1000.0]], requires_grad=True)
    h = entropy_from_logits(x)
    assert torch.allclose(h, torch.full((2,), math.log(2)))
    h.sum().backward()
    assert torch.isfinite(x.grad).all()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, generator=g, dtype=F64).to(torch.bfloat16)
    p = torch.softmax(logits.double(), -1)
    expected = -(p * p.log()).sum(-1)
    out = entropy_from_logits(logits)
    assert out.dtype == torch.float32 and torch.allclose(out.double(), expected, atol=1e-5)


def test_bad_arguments():
    ratio, adv, mask, seq_index, seq_lens, old, _ = hand_case()
    inp = LossInputs(old.clone(), old, adv, mask, seq_index, seq_lens, total_tokens=1, total_seqs=1)
    with pytest.raises(ValueError, match="aggregation"):
        ppo_clip(inp, LossSettings(clip_low=0.2, clip_high=0.2, agg="mean", norm_len=1))
    with pytest.raises(ValueError, match="advantages"):
        ppo_clip(LossInputs(old, old, adv[:3], mask, seq_index, seq_lens, total_tokens=1, total_seqs=1),
                 LossSettings(clip_low=0.2, clip_high=0.2, agg="token-mean", norm_len=1))
