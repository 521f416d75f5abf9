"""The modifier's weights, diagnostics and the corrected loss + gradient against the float64 oracles
of ``rc_reference`` (plain Python, written from the formulas, not from the plugin's code)."""

from __future__ import annotations

import math

import pytest
import rc_reference as ref
import torch
from rc_support import ragged_samples, synthetic_batch

from unirl.algorithms.losses import AGGREGATIONS, LossInputs, LossSettings, ppo_clip
from unirl.api import RunConfig, UniRLError
from unirl_rollout_correction.correction import RolloutCorrectionError, rollout_correction
from unirl_rollout_correction.options import MODES

CORRECTING = [m for m in MODES if m != "none"]
#: band/threshold per mode: geo_mask is a per-token-geometric-mean band, so it is much tighter
PARAMS = {"none": {}, "token_tis": {"threshold": 1.5}, "seq_tis": {"threshold": 2.0},
          "token_mask": {"threshold": 1.6, "threshold_lower": 0.7}, "seq_mask": {"threshold": 3.0},
          "geo_mask": {"threshold": 1.25, "threshold_lower": 0.85}}
NORM_LEN = 9.0
#: the three aggregations of the issue, plus any newer one core has and the oracle knows
KNOWN_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
AGGS = tuple(a for a in KNOWN_AGGS if a in AGGREGATIONS)
assert {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"} <= set(AGGS)


def config_for(mode: str, **over) -> RunConfig:
    section = {"mode": mode, **PARAMS[mode], **over}
    return RunConfig.model_validate({"algorithm": {"modifiers": ["rollout_correction"]},
                                     "rollout": {"max_new_tokens": int(NORM_LEN)},
                                     "plugins": {"rollout_correction": section}})


def lists(ts):
    return [[float(x) for x in t] for t in ts]


def oracle_weights(samples, b, mode):
    p = PARAMS[mode]
    return ref.weights(lists(b["old_logprobs"]), lists(b["rollout_logprobs"]), [s.loss_mask for s in samples],
                       mode=mode, threshold=p.get("threshold", 2.0), lower=p.get("threshold_lower"))


def run_modifier(samples, b, mode, **over):
    batch = {"advantages": b["advantages"], "old_logprobs": b["old_logprobs"], "rollout_logprobs": b["rollout_logprobs"]}
    metrics = rollout_correction(samples, batch, config_for(mode, **over))
    return batch, metrics


# ------------------------------------------------------------------------------------ weights


@pytest.mark.parametrize("mode", MODES)
def test_weights_match_oracle_on_ragged_empty_and_masked_rows(mode):
    samples = ragged_samples()
    b = synthetic_batch(samples)
    batch, _ = run_modifier(samples, b, mode)
    want = oracle_weights(samples, b, mode)
    if mode == "none":
        assert "token_weights" not in batch
        return
    got = batch["token_weights"]
    assert [t.shape for t in got] == [(len(s.response_ids),) for s in samples]
    assert all(t.dtype == torch.float32 and not t.requires_grad for t in got)
    for g, w in zip(got, want, strict=True):
        for gi, wi in zip(g.tolist(), w, strict=True):
            if wi is not None:
                assert gi == pytest.approx(wi, rel=1e-6, abs=1e-12)
    flat = [x for w in want for x in w if x is not None]
    assert min(flat) != max(flat), "the fixture must exercise truncation / masking"


@pytest.mark.parametrize("mode", MODES)
def test_diagnostics_match_oracle(mode):
    samples = ragged_samples()
    b = synthetic_batch(samples)
    _, metrics = run_modifier(samples, b, mode)
    p = PARAMS[mode]
    mask = [s.loss_mask for s in samples]
    want = ref.diagnostics(lists(b["old_logprobs"]), lists(b["rollout_logprobs"]), mask,
                           oracle_weights(samples, b, mode), mode=mode, threshold=p.get("threshold", 2.0),
                           lower=p.get("threshold_lower"))
    assert set(want) <= set(metrics)
    for k, v in want.items():
        assert metrics[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
        assert isinstance(metrics[k], float)
    if mode != "none":
        assert 0 < metrics["rc/clipped_token_frac"] < 1 and metrics["rc/ess_frac_global"] < 1


@pytest.mark.parametrize("mode", MODES)
def test_equal_policies_give_unit_weights(mode):
    samples = ragged_samples()
    b = synthetic_batch(samples)
    b["rollout_logprobs"] = [t.clone() for t in b["old_logprobs"]]
    batch, m = run_modifier(samples, b, mode)
    for t in batch.get("token_weights", []):
        assert torch.equal(t, torch.ones_like(t))
    assert (m["rc/weight_mean"], m["rc/weight_min"], m["rc/weight_max"]) == (1.0, 1.0, 1.0)
    assert m["rc/ess_frac_global"] == pytest.approx(1.0, abs=1e-15)
    assert (m["rc/clipped_token_frac"], m["rc/clipped_seq_frac"]) == (0.0, 0.0)
    assert (m["rc/logp_diff_abs_max"], m["rc/kl_k3"], m["rc/ppl_ratio"]) == (0.0, 0.0, 1.0)


def test_log_space_clamps_of_sequence_modes():
    """seq_tis: the product over the response is clamped in log space (no overflow / underflow to 0)."""
    samples = ragged_samples()[:1]  # 5 active tokens
    high = {"old_logprobs": [torch.zeros(5, dtype=torch.float64) - 0.1],
            "rollout_logprobs": [torch.full((5,), -10.1, dtype=torch.float64)], "advantages": [torch.ones(5)]}
    low = {"old_logprobs": high["rollout_logprobs"], "rollout_logprobs": high["old_logprobs"], "advantages": [torch.ones(5)]}
    batch, _ = run_modifier(samples, dict(high), "seq_tis", threshold=1e12)
    assert batch["token_weights"][0].tolist() == pytest.approx([math.exp(20.0)] * 5, rel=1e-6)  # sum 50 -> 20
    batch, _ = run_modifier(samples, dict(low), "seq_tis")
    assert batch["token_weights"][0].tolist() == pytest.approx([math.exp(-20.0)] * 5, rel=1e-6)  # not 0, not NaN
    batch, _ = run_modifier(samples, dict(high), "token_tis", threshold=1e12)
    assert batch["token_weights"][0].tolist() == pytest.approx([math.exp(10.0)] * 5, rel=1e-6)


def test_geo_mask_is_length_normalised():
    """The same per-token drift keeps a long sequence under geo_mask and drops it under seq_mask."""
    samples = ragged_samples()[3:4]  # 7 tokens, 5 active
    b = {"old_logprobs": [torch.full((7,), -1.0, dtype=torch.float64)],
         "rollout_logprobs": [torch.full((7,), -1.2, dtype=torch.float64)], "advantages": [torch.ones(7)]}
    geo, _ = run_modifier(samples, dict(b), "geo_mask", threshold=1.25, threshold_lower=0.8)
    seq, _ = run_modifier(samples, dict(b), "seq_mask", threshold=2.0)
    assert geo["token_weights"][0].tolist() == [1.0] * 7  # exp(0.2) = 1.22 inside [0.8, 1.25]
    assert seq["token_weights"][0][[0, 2, 3, 5, 6]].tolist() == [0.0] * 5  # exp(5 * 0.2) = 2.72 > 2


def test_reweights_an_earlier_modifiers_weights():
    samples = ragged_samples()
    b = synthetic_batch(samples)
    prior = [torch.full((len(s.response_ids),), 0.5) for s in samples]
    batch = {"old_logprobs": b["old_logprobs"], "rollout_logprobs": b["rollout_logprobs"], "token_weights": prior}
    rollout_correction(samples, batch, config_for("token_tis"))
    alone, _ = run_modifier(samples, b, "token_tis")
    for got, w in zip(batch["token_weights"], alone["token_weights"], strict=True):
        assert torch.allclose(got, 0.5 * w)


# --------------------------------------------------------------------------- loss and gradient


def loss_and_grad(samples, b, weights, *, agg, clip_low, clip_high):
    logp = torch.cat(b["logp"]).clone().requires_grad_(True)
    mask = torch.tensor([x for s in samples for x in s.loss_mask], dtype=torch.float64)
    seq_index = torch.tensor([i for i, s in enumerate(samples) for _ in s.response_ids], dtype=torch.long)
    seq_lens = torch.tensor([sum(s.loss_mask) for s in samples], dtype=torch.long)
    inp = LossInputs(logprobs=logp, old_logprobs=torch.cat(b["old_logprobs"]), advantages=torch.cat(b["advantages"]),
                     mask=mask, seq_index=seq_index, seq_lens=seq_lens, total_tokens=float(seq_lens.sum()),
                     total_seqs=float((seq_lens > 0).sum()),
                     token_weights=torch.cat(weights) if weights is not None else None)
    loss, _ = ppo_clip(inp, LossSettings(clip_low=clip_low, clip_high=clip_high, agg=agg, norm_len=NORM_LEN))
    loss.backward()
    return float(loss.detach()), logp.grad


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("mode", CORRECTING)
def test_corrected_loss_and_gradient_match_oracle(mode, agg):
    samples = ragged_samples()
    b = synthetic_batch(samples)
    clip_low, clip_high = 0.1, 0.35  # asymmetric (clip-higher)
    batch, _ = run_modifier(samples, b, mode)
    loss, grad = loss_and_grad(samples, b, batch["token_weights"], agg=agg, clip_low=clip_low, clip_high=clip_high)
    w = [[1.0 if x is None else x for x in ws] for ws in oracle_weights(samples, b, mode)]
    want_loss, want_grad = ref.ppo_loss_and_grad(lists(b["logp"]), lists(b["old_logprobs"]), lists(b["advantages"]),
                                                 [s.loss_mask for s in samples], w, clip_low=clip_low,
                                                 clip_high=clip_high, agg=agg, norm_len=NORM_LEN)
    assert loss == pytest.approx(want_loss, rel=1e-6, abs=1e-12)
    flat = [x for g in want_grad for x in g]
    assert grad.tolist() == pytest.approx(flat, rel=1e-6, abs=1e-12)
    # the fixture clips on both sides, so the asymmetry is exercised
    r = [math.exp(lp - o) for lps, os_, s in zip(lists(b["logp"]), lists(b["old_logprobs"]), samples, strict=True)
         for lp, o, m in zip(lps, os_, s.loss_mask, strict=True) if m]
    assert any(x > 1 + clip_high for x in r) and any(x < 1 - clip_low for x in r)
    assert any(1 - clip_high < x < 1 - clip_low for x in r) or any(1 + clip_low < x < 1 + clip_high for x in r)


@pytest.mark.parametrize("agg", AGGS)
def test_mode_none_leaves_the_loss_bit_identical(agg):
    samples = ragged_samples()
    b = synthetic_batch(samples)
    batch, metrics = run_modifier(samples, b, "none")
    assert set(batch) == {"advantages", "old_logprobs", "rollout_logprobs"}
    assert all(x is y for x, y in zip(batch["old_logprobs"], b["old_logprobs"], strict=True))
    assert metrics["rc/logp_diff_abs_max"] > 0  # diagnostics only
    got = loss_and_grad(samples, b, batch.get("token_weights"), agg=agg, clip_low=0.2, clip_high=0.28)
    want = loss_and_grad(samples, b, None, agg=agg, clip_low=0.2, clip_high=0.28)
    assert got[0] == want[0] and torch.equal(got[1], want[1])


def test_all_rows_masked_gives_zero_loss_and_neutral_metrics():
    samples = ragged_samples()
    for s in samples:
        s.loss_mask = [0] * len(s.response_ids)
    b = synthetic_batch(samples)
    batch, m = run_modifier(samples, b, "seq_mask")
    assert m["rc/active_tokens"] == 0 and m["rc/ess_frac_global"] == 1.0
    loss, grad = loss_and_grad(samples, b, batch["token_weights"], agg="token-mean", clip_low=0.2, clip_high=0.2)
    assert loss == 0.0 and torch.count_nonzero(grad) == 0


# --------------------------------------------------------------------------------- bad batches


def test_missing_rollout_logprobs_name_the_samples():
    samples = ragged_samples()
    b = synthetic_batch(samples)
    b["rollout_logprobs"][3] = torch.zeros(0)  # an engine that returned no log-probs for p1@t/1
    with pytest.raises(RolloutCorrectionError, match=r"missing for samples p1@t/1") as err:
        run_modifier(samples, b, "token_tis")
    assert isinstance(err.value, UniRLError)
    with pytest.raises(RolloutCorrectionError, match="batch\\['rollout_logprobs'\\] is missing"):
        rollout_correction(samples, {"old_logprobs": b["old_logprobs"]}, config_for("token_tis"))


def test_non_finite_log_probs_on_loss_tokens_name_the_samples():
    samples = ragged_samples()
    b = synthetic_batch(samples)
    b["rollout_logprobs"][0][2] = float("nan")
    b["rollout_logprobs"][3][1] = float("-inf")  # an inactive token: ignored
    with pytest.raises(RolloutCorrectionError, match=r"non-finite log-probs on loss tokens of samples p0@t/0$"):
        run_modifier(samples, b, "seq_tis")


def test_rollout_as_pi_old_is_refused_at_the_batch():
    samples = ragged_samples()
    b = synthetic_batch(samples)
    same = b["rollout_logprobs"]
    with pytest.raises(RolloutCorrectionError, match="old_logp_source: replay"):
        rollout_correction(samples, {"old_logprobs": same, "rollout_logprobs": same}, config_for("token_tis"))
