"""The seed's key ``algorithm.rollout_is_threshold``: the same correction as the plugin's keys (bit for
bit), and every way of setting it wrongly caught in preflight with the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rc_support import perturb_engine, ragged_samples, synthetic_batch

from unirl.algorithms.losses import LossInputs, LossSettings, ppo_clip
from unirl.api import ConfigError, PreflightError, load_config, load_kernel, train
from unirl.preflight import check, preflight
from unirl_rollout_correction.correction import rollout_correction
from unirl_rollout_correction.options import options_of

ROOT = Path(__file__).resolve().parents[3]
SOURCE = "unirl-rollout-correction"
ALIAS = ["algorithm.rollout_is_threshold=1.5"]
KEYS = ["algorithm.modifiers=[rollout_correction]", "plugins.rollout_correction={mode: token_tis, threshold: 1.5}"]
TINY = ["trainer.steps=2", "trainer.prompts_per_step=4", "trainer.eval_every=0", "trainer.progress=false",
        "trainer.plot=false", "data.arith.n_train=16", "data.arith.n_eval=2", "rollout.n=2",
        "rollout.max_new_tokens=4", "trainer.eval_k=1", "sft.steps=0", "trainer.save_every=0",
        "trainer.export_hf=false", "model.build={hidden_size: 64, intermediate_size: 128}"]
NUMERIC = ("reward", "loss", "pg_loss", "grad_norm", "clip_frac", "approx_kl", "ratio_max", "entropy")


def cfg(*over: str):
    return load_config(ROOT / "recipes" / "arith-tiny.yaml", list(over))


def test_alias_means_token_tis_with_its_threshold():
    alias, keys = cfg(*ALIAS), cfg(*KEYS)
    assert alias.algorithm.modifiers == keys.algorithm.modifiers == ["rollout_correction"]
    assert options_of(alias) == options_of(keys)
    assert options_of(alias).mode == "token_tis" and options_of(alias).threshold == 1.5
    assert cfg().algorithm.modifiers == [] and options_of(cfg()).mode == "none"  # unset: off


def test_alias_gives_the_same_loss_and_gradient_bit_for_bit():
    samples = ragged_samples()
    b = synthetic_batch(samples)
    out = []
    for config in (cfg(*ALIAS), cfg(*KEYS)):
        batch = {k: [t.clone() for t in b[k]] for k in ("old_logprobs", "rollout_logprobs", "advantages")}
        metrics = rollout_correction(samples, batch, config)
        logp = [t.clone().requires_grad_(True) for t in b["logp"]]
        flat = torch.cat(logp)
        mask = torch.cat([torch.tensor(s.loss_mask or [1] * len(s.response_ids), dtype=torch.float64)
                          for s in samples])
        lens = torch.tensor([len(s.response_ids) for s in samples])
        inp = LossInputs(logprobs=flat, old_logprobs=torch.cat(batch["old_logprobs"]),
                         advantages=torch.cat(batch["advantages"]), mask=mask,
                         seq_index=torch.repeat_interleave(torch.arange(len(samples)), lens), seq_lens=lens,
                         total_tokens=float(mask.sum()), total_seqs=float(len(samples)),
                         token_weights=torch.cat(batch["token_weights"]).to(torch.float64))
        loss, _ = ppo_clip(inp, LossSettings(clip_low=0.2, clip_high=0.28, agg="token-mean", norm_len=6.0))
        loss.backward()
        out.append((loss.detach(), [t.grad for t in logp], batch["token_weights"], metrics))
    (la, ga, wa, ma), (lb, gb, wb, mb) = out
    assert torch.equal(la, lb) and all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(wa, wb, strict=True)) and ma == mb
    assert ma["rc/clipped_token_frac"] > 0  # the cap did bite: the comparison is not between unit weights


def test_alias_run_is_bit_identical_to_the_plugin_keys_run(tmp_path):
    """Two steps of real training on a perturbed engine (a real mismatch): every numeric metric equal."""
    runs = []
    for name, over in (("alias", ALIAS), ("keys", KEYS)):
        kernel = load_kernel()
        perturb_engine(kernel, "inprocess", sigma=0.2)
        config = cfg(*TINY, *over, f"run.output_dir={tmp_path / name}", "run.name=t")
        runs.append(train(config, kernel).history[1:])
    for a, k in zip(*runs, strict=True):
        assert {x: a[x] for x in NUMERIC} == {x: k[x] for x in NUMERIC}
        rc = sorted(x for x in a if x.startswith("rc/"))
        assert rc and {x: a[x] for x in rc} == {x: k[x] for x in rc}
        assert a["rc/logp_diff_abs_max"] > 1e-3  # the weights were not all 1


def test_consistent_repetition_is_allowed():
    assert [v for v in preflight(cfg(*ALIAS, *KEYS), load_kernel()) if v.source == SOURCE] == []


CONFLICTS = [
    ("another mode", ["plugins.rollout_correction={mode: seq_mask}"], "mode is seq_mask"),
    ("another threshold", ["plugins.rollout_correction={mode: token_tis, threshold: 3.0}"], "threshold is 3.0"),
    ("threshold only", ["plugins.rollout_correction={threshold: 2.0}"], "threshold is 2.0"),
    ("mode none", ["plugins.rollout_correction={mode: none}"], "mode is none"),
]


@pytest.mark.parametrize(("why", "over", "says"), CONFLICTS, ids=[c[0] for c in CONFLICTS])
def test_alias_and_keys_disagreeing_is_a_preflight_error(why, over, says, tmp_path, monkeypatch):
    found = [v for v in preflight(cfg(*ALIAS, *over), load_kernel()) if v.source == SOURCE]
    assert [v.field for v in found] == ["algorithm.rollout_is_threshold"], found
    assert says in found[0].message and "plugins.rollout_correction" in found[0].message
    assert "algorithm.rollout_is_threshold alone" in found[0].fix  # the fix names both ways out
    from unirl.api import Qwen3Adapter
    built = []
    monkeypatch.setattr(Qwen3Adapter, "build_model", lambda *a, **k: built.append(1))
    with pytest.raises(PreflightError, match=r"algorithm\.rollout_is_threshold"):
        check(cfg(*ALIAS, *over, f"run.output_dir={tmp_path}"), load_kernel())
    assert built == [] and not any(tmp_path.iterdir())  # before any model or run directory


def test_alias_requires_replay():
    found = [v for v in preflight(cfg(*ALIAS, "algorithm.old_logp_source=rollout"), load_kernel())
             if v.source == SOURCE]
    assert [v.field for v in found] == ["algorithm.old_logp_source"]
    assert "rollout_is_threshold" in found[0].message and "replay" in found[0].fix


def test_alias_without_the_plugin_names_the_alias_and_the_package(monkeypatch):
    monkeypatch.setenv("UNIRL_PLUGINS", "vllm")  # core + an unrelated plugin: rollout_correction is absent
    found = [v for v in preflight(cfg(*ALIAS), load_kernel()) if "rollout_is_threshold" in v.field]
    assert len(found) == 1 and "unirl-rollout-correction" in found[0].fix


@pytest.mark.parametrize("bad", ["0", "-1", "big"])
def test_bad_alias_value_names_the_field(bad):
    with pytest.raises(ConfigError, match=r"algorithm\.rollout_is_threshold"):
        cfg(f"algorithm.rollout_is_threshold={bad}")
