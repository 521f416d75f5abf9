"""Oracle tests for the policy-loss pieces added with the algorithm menu (GSPO, GSPO-token, dual-clip,
k2, the k3 clamp, seq-mean-token-sum), and the run's LossSettings.

Every reference below is written from the paper's equation, row by row in float64 on a ragged batch
(a normal row, an empty row, a length-1 row, a fully masked row, a row with a masked hole), never from
our implementation; loss and gradient w.r.t. the log-probs are compared in every aggregation.
"""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch

from unirl.algorithms.losses import (
    AGGREGATIONS,
    GSPOOptions,
    LossInputs,
    LossSettings,
    PPOClipOptions,
    check_loss_signature,
    gspo,
    gspo_token,
    kl_penalty,
    metric_reduce_of,
    ppo_clip,
    value_loss,
)
from unirl.config import AlgorithmSection
from unirl.kernel.errors import ConfigError, PluginError

F64 = torch.float64
LENS = (5, 0, 1, 3, 4)  # row 1 empty, row 2 length 1, row 3 fully masked, row 4 has a masked hole
NORM_LEN = 7.0


def ragged(seed: int, *, scale: float, seq_adv: bool):
    """Rows of (logp, old, adv, ref, w, mask) as lists of 1-D float64 tensors."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(LENS):
        old = -torch.rand(n, generator=g, dtype=F64) * 3 - 0.1
        logp = old + scale * torch.randn(n, generator=g, dtype=F64) * (1 + i % 3)
        adv = (torch.full((n,), float(torch.randn(1, generator=g, dtype=F64))) if seq_adv
               else torch.randn(n, generator=g, dtype=F64))
        ref = old + 0.5 * torch.randn(n, generator=g, dtype=F64)
        w = torch.rand(n, generator=g, dtype=F64) + 0.5
        mask = torch.ones(n, dtype=F64)
        if i == 3:
            mask[:] = 0
            logp = torch.full((n,), -math.inf, dtype=F64)  # garbage under a full mask
            old = torch.full((n,), math.nan, dtype=F64)
        if i == 4:
            mask[1] = 0
        rows.append(dict(logp=logp, old=old, adv=adv, ref=ref, w=w, mask=mask))
    return rows


def flat(rows, logp_rows, *, total_tokens=0.0, total_seqs=0.0, with_ref=False, weighted=False):
    cat = lambda k: torch.cat([r[k] for r in rows])  # noqa: E731
    seq_index = torch.cat([torch.full((len(r["mask"]),), i, dtype=torch.long) for i, r in enumerate(rows)])
    seq_lens = torch.tensor([int(r["mask"].sum()) for r in rows])
    return LossInputs(torch.cat(logp_rows), cat("old"), cat("adv"), cat("mask"), seq_index, seq_lens,
                      total_tokens=total_tokens, total_seqs=total_seqs, ref_logprobs=cat("ref") if with_ref else None,
                      token_weights=cat("w") if weighted else None)


def denominators(rows):
    tokens = sum(float(r["mask"].sum()) for r in rows)
    seqs = sum(1.0 for r in rows if r["mask"].sum() > 0)
    return tokens, seqs


def reference_aggregate(per_row_terms, rows, agg):
    """The aggregation definitions: per_row_terms[i] are the masked-in token losses of row i."""
    T, S = denominators(rows)
    total = torch.zeros((), dtype=F64)
    for terms in per_row_terms:
        if agg == "token-mean":
            total = total + terms.sum() / T
        elif agg == "seq-mean-token-mean":
            total = total + (terms.sum() / len(terms) if len(terms) else 0.0) / S
        elif agg == "seq-mean-token-sum":
            total = total + terms.sum() / S
        elif agg == "seq-mean-token-sum-norm":
            total = total + terms.sum() / NORM_LEN / S
    return total


def run_ours(loss_fn, rows, agg, *, with_ref=False, weighted=False, clip_low=0.2, clip_high=0.2, **settings):
    """``loss_fn`` on the flattened rows: ``settings`` are further LossSettings fields (options, kl_...)."""
    leaves = [r["logp"].clone().requires_grad_(True) for r in rows]
    T, S = denominators(rows)
    inp = flat(rows, leaves, total_tokens=T, total_seqs=S, with_ref=with_ref, weighted=weighted)
    loss, metrics = loss_fn(inp, LossSettings(clip_low=clip_low, clip_high=clip_high, agg=agg, norm_len=NORM_LEN,
                                              **settings))
    loss.backward()
    return loss.detach(), torch.cat([x.grad for x in leaves]), metrics


def run_reference(term_fn, rows, agg):
    """term_fn(row, logp_masked_in) -> per-token losses of the masked-in tokens of the row."""
    leaves = [r["logp"].clone().requires_grad_(True) for r in rows]
    terms = []
    for r, lp in zip(rows, leaves, strict=True):
        m = r["mask"] > 0
        terms.append(term_fn({k: v[m] for k, v in r.items()}, lp[m]))
    loss = reference_aggregate(terms, rows, agg)
    if loss.requires_grad:
        loss.backward()
    grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]
    return loss.detach(), torch.cat(grads)


def assert_match(ours, ref):
    (l1, g1), (l2, g2) = ours[:2], ref
    assert torch.isfinite(l1) and torch.isfinite(g1).all()
    assert torch.allclose(l1, l2, atol=1e-12, rtol=1e-10), (l1, l2)
    assert torch.allclose(g1, g2, atol=1e-12, rtol=1e-10), (g1, g2)


# ----------------------------------------------------------------------------- GSPO (arXiv:2507.18071)
def gspo_terms(eps_low, eps_high, token_level, weighted):
    """GSPO eq. (5)-(7): s_i = (pi(y_i)/pi_old(y_i))^(1/|y_i|); J = min(s_i A, clip(s_i) A).
    GSPO-token eq. (13): s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]."""

    def fn(row, lp):
        if len(lp) == 0:
            return lp.new_zeros(0)
        s = torch.exp((lp - row["old"]).sum() / len(lp))
        if token_level:
            s = s.detach() * torch.exp(lp - lp.detach())
        else:
            s = s.expand(len(lp))
        A = row["adv"]
        objective = torch.minimum(s * A, torch.clamp(s, 1 - eps_low, 1 + eps_high) * A)
        return -objective * (row["w"] if weighted else 1.0)

    return fn


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("token_level", [False, True])
@pytest.mark.parametrize("clip,scale", [((3e-4, 4e-4), 3e-4), ((0.2, 0.28), 0.3)])
@pytest.mark.parametrize("weighted", [False, True])
def test_gspo_matches_the_paper(agg, token_level, clip, scale, weighted):
    rows = ragged(1, scale=scale, seq_adv=not token_level)
    fn = gspo_token if token_level else gspo
    ours = run_ours(fn, rows, agg, options=GSPOOptions(clip_low=clip[0], clip_high=clip[1]), weighted=weighted)
    assert_match(ours, run_reference(gspo_terms(*clip, token_level, weighted), rows, agg))
    m = ours[2]
    assert 0.0 <= float(m["clip_frac"]) <= 1.0 and math.isfinite(float(m["ratio_max"]))


def test_gspo_exercises_both_branches_at_the_paper_clip():
    rows = ragged(1, scale=3e-4, seq_adv=True)
    live = [r for r in rows if r["mask"].sum() > 0]
    s = [float(torch.exp((r["logp"] - r["old"])[r["mask"] > 0].mean())) for r in live]
    inside = [1 - 3e-4 <= x <= 1 + 4e-4 for x in s]
    assert any(inside) and not all(inside), s  # the oracle above covers clipped and unclipped sequences


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_gspo_token_equals_gspo_with_sequence_advantages(agg):
    rows = ragged(2, scale=0.3, seq_adv=True)
    wide = GSPOOptions(clip_low=0.2, clip_high=0.28)
    a = run_ours(gspo, rows, agg, options=wide)
    b = run_ours(gspo_token, rows, agg, options=wide)
    assert torch.allclose(a[0], b[0], atol=1e-12) and torch.allclose(a[1], b[1], atol=1e-12)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gspo_token_differs_from_gspo_under_token_weights(agg):
    """Same loss value, different gradient: gspo spreads each token's weight over its sequence through
    s_i (every token of i gets -A s_i mean_i(w) / |y_i| per unit of aggregation), gspo_token keeps it on
    its own token (-A s_i w_t). So they are equal only when weights are uniform within each sequence."""
    rows = ragged(2, scale=0.3, seq_adv=True)
    wide = GSPOOptions(clip_low=0.2, clip_high=0.28)
    a = run_ours(gspo, rows, agg, options=wide, weighted=True)
    b = run_ours(gspo_token, rows, agg, options=wide, weighted=True)
    assert torch.allclose(a[0], b[0], atol=1e-12)  # the value: s_{i,t} == s_i
    assert not torch.allclose(a[1], b[1], atol=1e-6)  # the gradient: where the weight lands
    for r in rows:  # uniform weights within each sequence: equal again
        r["w"] = torch.full_like(r["w"], float(r["w"].mean()) if len(r["w"]) else 1.0)
    a = run_ours(gspo, rows, agg, options=wide, weighted=True)
    b = run_ours(gspo_token, rows, agg, options=wide, weighted=True)
    assert torch.allclose(a[1], b[1], atol=1e-12)


@pytest.mark.parametrize("fn", [gspo, gspo_token])
def test_gspo_micro_batches_sum_to_the_full_batch(fn):
    rows = ragged(3, scale=0.3, seq_adv=False)
    T, S = denominators(rows)
    settings = LossSettings(clip_low=0.2, clip_high=0.2, agg="seq-mean-token-mean", norm_len=NORM_LEN, kl_coef=0.1,
                            options=GSPOOptions(clip_low=0.2, clip_high=0.28))
    kw = dict(total_tokens=T, total_seqs=S, with_ref=True, weighted=True)
    full_leaves = [r["logp"].clone().requires_grad_(True) for r in rows]
    full, _ = fn(flat(rows, full_leaves, **kw), settings)
    full.backward()
    total = torch.zeros((), dtype=F64)
    grads = []
    for part in (rows[:2], rows[2:]):
        leaves = [r["logp"].clone().requires_grad_(True) for r in part]
        loss, _ = fn(flat(part, leaves, **kw), settings)
        loss.backward()
        total = total + loss.detach()
        grads += [x.grad for x in leaves]
    assert torch.allclose(total, full.detach(), atol=1e-12)
    assert torch.allclose(torch.cat(grads), torch.cat([x.grad for x in full_leaves]), atol=1e-12)


# ----------------------------------------------------------------------------- dual-clip (arXiv:1912.09729)
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("c", [None, 3.0, 1.5])
def test_dual_clip_matches_the_paper(agg, c):
    """Ye et al. 2020 eq. (5): for A < 0 the objective is max(min(r A, clip(r) A), c A)."""
    rows = ragged(4, scale=0.5, seq_adv=False)
    # row 0 by hand: r > 3 with A < 0 (dual-clipped for both c), r > 3 with A > 0 (clipped), r in (1.5, 3)
    # with A < 0 (dual-clipped only for c = 1.5), r < 1 - 0.2 with A < 0, r inside
    rows[0]["adv"] = torch.tensor([-1.0, 2.0, -0.5, -0.7, 0.3], dtype=F64)
    rows[0]["logp"] = rows[0]["old"] + torch.log(torch.tensor([5.0, 4.0, 2.0, 0.5, 1.1], dtype=F64))

    def fn(row, lp):
        r = torch.exp(lp - row["old"])
        A = row["adv"]
        ppo = torch.minimum(r * A, torch.clamp(r, 0.8, 1.28) * A)
        obj = torch.where(A < 0, torch.maximum(ppo, c * A), ppo) if c is not None else ppo
        return -obj

    ours = run_ours(ppo_clip, rows, agg, clip_low=0.2, clip_high=0.28, options=PPOClipOptions(clip_ratio_c=c))
    assert_match(ours, run_reference(fn, rows, agg))
    if c is not None:
        assert float(ours[2]["dual_clip_frac"]) > 0  # the case is exercised
    else:
        assert "dual_clip_frac" not in ours[2]


def test_dual_clip_rejects_c_not_above_one():
    rows = ragged(4, scale=1.0, seq_adv=False)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        run_ours(ppo_clip, rows, "token-mean", options=PPOClipOptions(clip_ratio_c=1.0))
    with pytest.raises(ValueError, match="clip_ratio_c"):  # past the model's validation too
        run_ours(ppo_clip, rows, "token-mean", options=PPOClipOptions.model_construct(clip_ratio_c=1.0))


# ----------------------------------------------------------------------------- KL estimators (Schulman 2020)
def kl_terms(est, clamp):
    def fn(row, lp):
        log_r = row["ref"] - lp  # log(pi_ref / pi) on samples of pi
        if est == "k1":
            return -log_r
        if est == "k2":
            return 0.5 * log_r ** 2
        k3 = torch.exp(log_r) - log_r - 1
        return k3 if clamp is None else torch.clamp(k3, -clamp, clamp)

    return fn


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("est,clamp", [("k1", 10.0), ("k2", 10.0), ("k3", 10.0), ("k3", None), ("k3", 0.5)])
def test_kl_in_loss_matches_the_estimators(agg, est, clamp):
    rows = ragged(5, scale=0.3, seq_adv=False)
    for r in rows:  # advantages 0: the loss is kl_coef * agg(kl); push some log-ratios past the clamp
        r["adv"] = torch.zeros_like(r["adv"])
        r["ref"] = r["logp"] + torch.linspace(-3.0, 3.5, len(r["ref"]), dtype=F64)
    coef = 0.3
    ours = run_ours(ppo_clip, rows, agg, clip_low=0.2, clip_high=0.2, with_ref=True, kl_coef=coef,
                    kl_estimator=est, kl_clamp=clamp)
    ref = run_reference(lambda row, lp: coef * kl_terms(est, clamp)(row, lp), rows, agg)
    assert_match(ours, ref)


def test_k3_clamp_bounds_value_and_gradient():
    logp = torch.tensor([-5.0, -1.0, -1.0], dtype=F64, requires_grad=True)
    ref = torch.tensor([-1.0, -1.2, 5.0], dtype=F64)  # s = 4 (k3 = e^4 - 5 = 49.6), -0.2, 6
    k = kl_penalty(logp, ref, "k3")
    k.sum().backward()
    assert torch.allclose(k, torch.tensor([10.0, math.exp(-0.2) + 0.2 - 1, 10.0], dtype=F64))
    assert logp.grad[0] == 0 and logp.grad[2] == 0 and logp.grad[1] == pytest.approx(1 - math.exp(-0.2))
    raw = kl_penalty(logp.detach(), ref, "k3", clamp=None)
    assert float(raw[0]) == pytest.approx(math.exp(4) - 5)


# ----------------------------------------------------------------------------- seq-mean-token-sum
@pytest.mark.parametrize("weighted", [False, True])
def test_seq_mean_token_sum_by_definition(weighted):
    rows = ragged(6, scale=0.3, seq_adv=False)

    def fn(row, lp):
        r = torch.exp(lp - row["old"])
        obj = torch.minimum(r * row["adv"], torch.clamp(r, 0.8, 1.2) * row["adv"])
        return -obj * (row["w"] if weighted else 1.0)

    ours = run_ours(ppo_clip, rows, "seq-mean-token-sum", clip_low=0.2, clip_high=0.2, weighted=weighted)
    assert_match(ours, run_reference(fn, rows, "seq-mean-token-sum"))


# ----------------------------------------------------------------------------- value loss metric fix
def test_vf_clip_frac_counts_no_in_range_token_in_fp32():
    """|V - V_old| <= c must never count as clipped (old + clamp(V - old) could be 1 ulp off V)."""
    g = torch.Generator().manual_seed(0)
    n = 20000
    old, v, ret = (torch.randn(n, generator=g) * 0.3 for _ in range(3))
    inside = (v - old).abs() <= 0.2
    old_way = old + (v - old).clamp(-0.2, 0.2)  # the former formula: rounding makes "clipped" in-range tokens
    assert (((old_way - ret) ** 2 > (v - ret) ** 2) & inside).sum() > 0
    _, m = value_loss(v[inside], old[inside], ret[inside], torch.ones(int(inside.sum())), clip=0.2,
                      total_tokens=float(inside.sum()))
    assert float(m["vf_clip_frac"]) == 0.0
    # out of range with the clipped branch larger still counts, and the gradient is 0 there
    vv = torch.tensor([1.5], dtype=F64, requires_grad=True)
    loss, m = value_loss(vv, torch.tensor([1.0], dtype=F64), torch.tensor([2.0], dtype=F64),
                         torch.ones(1, dtype=F64), clip=0.2, total_tokens=1.0)
    loss.backward()
    assert float(m["vf_clip_frac"]) == 1.0 and float(vv.grad) == 0.0
    assert float(loss.detach()) == pytest.approx(0.5 * (1.2 - 2.0) ** 2)


# ----------------------------------------------------------------------------- the run's LossSettings
def test_loss_settings_are_frozen_and_picklable():
    settings = LossSettings.from_algorithm(AlgorithmSection(), norm_len=64, options=PPOClipOptions(clip_ratio_c=3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.kl_coef = 1.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="frozen"):  # the options inside are frozen as well
        settings.options.clip_ratio_c = 5.0  # type: ignore[union-attr]
    assert pickle.loads(pickle.dumps(settings)) == settings  # FSDP ranks / Ray workers get the same settings


def test_loss_settings_from_algorithm_bind_options_clamp_and_kl_form():
    alg = AlgorithmSection(loss="gspo", clip_low=0.1, clip_high=0.3, loss_agg="seq-mean-token-mean", kl_coef=0.1,
                           kl_estimator="k2", kl_clamp=None, kl_form="reward")
    settings = LossSettings.from_algorithm(alg, norm_len=32, options=GSPOOptions())
    assert metric_reduce_of(gspo)["ratio_max"] == "max"
    assert settings == LossSettings(clip_low=0.1, clip_high=0.3, agg="seq-mean-token-mean", norm_len=32, kl_coef=0.0,
                                    kl_estimator="k2", kl_clamp=None, options=GSPOOptions())
    # kl_form: reward keeps the kl metric but adds no KL term; GSPO clips with its own (paper) range
    rows = ragged(1, scale=3e-4, seq_adv=True)
    a = run_ours(gspo, rows, "seq-mean-token-mean", clip_low=0.1, clip_high=0.3, with_ref=True,
                 **{k: getattr(settings, k) for k in ("kl_coef", "kl_estimator", "kl_clamp", "options")})
    b = run_ours(gspo, rows, "seq-mean-token-mean", options=GSPOOptions(clip_low=3e-4, clip_high=4e-4))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and "kl" in a[2] and "kl" not in b[2]
    assert LossSettings.from_algorithm(AlgorithmSection(kl_coef=0.1), norm_len=1).kl_coef == 0.1
    assert LossSettings.from_algorithm(AlgorithmSection(), norm_len=1).options_as(PPOClipOptions) == PPOClipOptions()
    with pytest.raises(TypeError, match="PPOClipOptions"):  # settings built for another loss
        run_ours(ppo_clip, rows, "token-mean", options=GSPOOptions())


def test_loss_settings_name_the_bad_field():
    # a value the algorithm section did not validate (model_copy) is named by its config field
    for field, value, where in [("loss_agg", "mean", "algorithm.loss_agg"), ("kl_estimator", "k9", "algorithm.kl_estimator"),
                                ("kl_clamp", 0.0, "algorithm.kl_clamp"), ("clip_high", -0.1, "algorithm.clip_high")]:
        alg = AlgorithmSection().model_copy(update={field: value})
        with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
            LossSettings.from_algorithm(alg, norm_len=1)
    with pytest.raises(ConfigError, match=r"rollout\.max_new_tokens"):
        LossSettings.from_algorithm(AlgorithmSection(), norm_len=-1)
    with pytest.raises(ValueError, match=r"LossSettings\.kl_estimator"):  # built by hand: the settings' own field
        LossSettings(clip_low=0.2, clip_high=0.2, agg="token-mean", norm_len=1, kl_estimator="k9")


def test_the_runtime_validates_loss_and_estimator_options_once():
    """``build_runtime`` asks the kernel once for each options object; the settings and every step's
    estimator call get those validated objects, never the raw dicts again."""
    from unirl.algorithms.advantages import GRPOOptions, _options
    from unirl.config import RunConfig
    from unirl.kernel import load_kernel
    from unirl.kernel.errors import OptionsError
    from unirl.runtime import build_runtime

    kernel = load_kernel()
    calls: list[str] = []
    real = kernel.options

    def counting(kind, name, raw, at, **kw):
        calls.append(at)
        return real(kind, name, raw, at, **kw)

    kernel.options = counting  # type: ignore[method-assign]
    config = RunConfig.model_validate({"algorithm": {"loss_options": {"clip_ratio_c": 3},
                                                     "estimator_options": {"scope": "batch"}}})
    rt = build_runtime(config, kernel)
    # each options object once: the loss's and the estimator's, and the engine's and actor's (their declared
    # capabilities are read from the validated options, unirl.declared)
    assert sorted(calls) == ["actor.options", "algorithm.estimator_options", "algorithm.loss_options",
                             "rollout.options"]
    assert rt.loss_settings.options == PPOClipOptions(clip_ratio_c=3)
    assert rt.estimator_options == GRPOOptions(scope="batch")
    assert _options(rt.estimator_options, GRPOOptions) is rt.estimator_options  # taken as is, not re-parsed
    for section, where in [({"loss_options": {"clip_c": 3}}, "algorithm.loss_options.clip_c"),
                           ({"loss_options": {"clip_ratio_c": 0.5}}, "algorithm.loss_options.clip_ratio_c"),
                           ({"estimator_options": {"colour": 1}}, "algorithm.estimator_options.colour")]:
        with pytest.raises(OptionsError) as err:
            build_runtime(RunConfig.model_validate({"algorithm": section}), load_kernel())
        assert [v.field for v in err.value.violations] == [where]


def test_a_loss_with_another_signature_is_a_plugin_error():
    def old_style(inp, *, clip_low, clip_high, agg, total_tokens, total_seqs, norm_len):
        raise AssertionError("never called")

    check_loss_signature(ppo_clip)
    check_loss_signature(lambda inp, settings: None)
    with pytest.raises(PluginError, match="old_style.*loss\\(inp: LossInputs, settings: LossSettings\\)"):
        check_loss_signature(old_style)


def test_preflight_names_a_loss_written_to_another_signature():
    """A third-party loss still written to the old keyword signature is reported before any model is
    built, naming algorithm.loss and the contract, instead of a TypeError in the first micro-batch."""
    from types import SimpleNamespace

    from unirl.config import RunConfig
    from unirl.kernel import hookimpl, load_kernel
    from unirl.preflight import core_violations

    def old_style(inp, *, clip_low, clip_high, agg, total_tokens, total_seqs, norm_len):
        raise AssertionError("never called")

    plugin = SimpleNamespace(unirl_policy_losses=hookimpl(lambda: {"old_style": old_style, "new_style": ppo_clip}))
    kernel = load_kernel(extra=[("old_loss", plugin)])
    bad = [v for v in core_violations(RunConfig.model_validate({"algorithm": {"loss": "old_style"}}), kernel)
           if v.field == "algorithm.loss"]
    assert len(bad) == 1 and "LossSettings" in bad[0].message, bad
    ok = core_violations(RunConfig.model_validate({"algorithm": {"loss": "new_style"}}), kernel)
    assert not [v for v in ok if v.field == "algorithm.loss"]
