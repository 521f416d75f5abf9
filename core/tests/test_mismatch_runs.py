"""The mismatch metrics of whole trainer runs on the embedded engine (unirl.mismatch, docs/mismatch.md).

* sync, parity off: the staleness term is exactly 0 at every step and the numerics term is the total;
  the alarm stays quiet (the demo recipe, shrunk);
* an engine perturbed on purpose (its final norm scaled by 1.5 after every load: a logit temperature
  the replay does not apply) moves the numerics term past the alarm's default threshold, leaves the
  staleness term at exactly 0, and the alarm warns once;
* async with ``max_staleness: 2``: the staleness term carries the policy's move and the numerics term
  stays at the fp32 kernels' last bits; with ``mismatch_every: 2`` only every other step replays;
* the parity recipe (``parity-tiny-embedded``, shrunk, its gate on): the numerics term is exactly 0 at
  every step of a real run, and the alarm stays quiet.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from unirl.config import load_config
from unirl.engine.torch_engine import TorchEngine
from unirl.kernel import load_kernel
from unirl.kernel.hookspecs import hookimpl
from unirl.mismatch.alarm import MismatchWarning
from unirl.trainer.loop import train

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["sft.steps=0", "trainer.steps=3", "trainer.prompts_per_step=4", "trainer.eval_every=0",
         "trainer.progress=false", "trainer.plot=false", "trainer.export_hf=false", "data.arith.n_train=64",
         "data.arith.n_eval=8", "rollout.n=4", "rollout.max_new_tokens=4", "reward.name=token-parity",
         "model.build={hidden_size: 64, intermediate_size: 128}", "actor.lr=3e-3"]
TERMS = ("abs_mean", "k3", "frac_gt_1e-3", "frac_gt_1e-1")


class PerturbedEngine(TorchEngine):
    """The embedded engine, serving its final norm scaled by 1.5 after every weight load."""

    name = "torch-perturbed"

    def load_weights(self, staged, version):
        receipts = super().load_weights(staged, version)
        with torch.no_grad():
            self.model.model.norm.weight.mul_(1.5)
        return receipts


class Plugins:
    """Reward = parity of the sampled ids' sum (every group has spread: every step moves the weights)."""

    @hookimpl
    def unirl_rewards(self):
        return {"token-parity": lambda completion, sample: float(sum(sample.response_ids) % 2)}

    @hookimpl
    def unirl_rollout_engines(self):
        return {"torch-perturbed": PerturbedEngine}


def run(tmp_path, name, *extra, recipe="arith-tiny.yaml"):
    kernel = load_kernel()
    kernel.register(Plugins(), entry_point="mismatch-test", dist="test-mismatch", version="0")
    config = load_config(ROOT / "recipes" / recipe,
                         [*SMALL, f"run.output_dir={tmp_path}", f"run.name={name}", *extra])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(config, kernel)
    return result.history[1:], [w for w in caught if issubclass(w.category, MismatchWarning)]


def term(row, name):
    return {t: row[f"mismatch/{name}_{t}"] for t in TERMS}


@pytest.mark.slow
@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
def test_sync_staleness_is_exactly_zero_and_a_perturbed_engine_moves_numerics_only(tmp_path):
    rows, alarms = run(tmp_path, "sync")
    assert len(rows) == 3 and not alarms and not any("mismatch/alarm" in r for r in rows)
    for r in rows:
        assert term(r, "staleness") == dict.fromkeys(TERMS, 0.0)
        assert term(r, "numerics") == term(r, "total")
        assert r["mismatch/numerics_abs_mean"] < 1e-5 and r["mismatch/numerics_k3"] < 1e-9

    bent, alarms = run(tmp_path, "perturbed", "rollout.engine=torch-perturbed")
    for r in bent:
        assert term(r, "staleness") == dict.fromkeys(TERMS, 0.0)
        assert r["mismatch/numerics_k3"] > 1e-3 and r["mismatch/numerics_frac_gt_1e-3"] > 0.9
    text = str(alarms[0].message)  # a test engine: no parity profile names it, and the alarm says so
    assert len(alarms) == 1 and "numerics term's k3 KL" in text and "no packaged parity profile covers" in text
    assert [r.get("mismatch/alarm") for r in bent] == [1.0, None, None]  # once a run


@pytest.mark.slow
@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
def test_async_max_staleness_two_moves_the_staleness_term(tmp_path):
    rows, alarms = run(tmp_path, "async", "rollout.mode=async", "rollout.max_staleness=2",
                       "diagnostics.mismatch_every=2", "trainer.steps=4")
    assert not alarms and [r["staleness_max"] for r in rows] == [0, 1, 1, 1]
    # step 1: every token at the trained version (free); step 3: replayed (an even index); 2 and 4: not measured
    assert [("mismatch/numerics_k3" in r) for r in rows] == [True, False, True, False]
    assert all("mismatch/total_k3" in r for r in rows)
    assert rows[0]["mismatch/staleness_abs_mean"] == 0.0
    stale = rows[2]
    assert stale["mismatch/unheld_tokens"] == 0.0
    assert stale["mismatch/staleness_abs_mean"] > 1e-3 and stale["mismatch/numerics_abs_mean"] < 1e-5
    assert stale["mismatch/staleness_abs_mean"] == pytest.approx(stale["mismatch/total_abs_mean"], rel=1e-3)


@pytest.mark.slow
@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
def test_parity_recipe_has_numerics_exactly_zero_and_no_alarm(tmp_path, monkeypatch):
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    monkeypatch.delenv("UNIRL_PARITY_DIR", raising=False)
    rows, alarms = run(tmp_path, "parity", "trainer.steps=2", "rollout.max_new_tokens=8",
                       recipe="parity-tiny-embedded.yaml")
    assert len(rows) == 2 and not alarms and not any("mismatch/alarm" in r for r in rows)
    for r in rows:  # the gate passed every step: the engine's log-probs are the replay's, bit for bit
        assert term(r, "numerics") == dict.fromkeys(TERMS, 0.0) == term(r, "staleness") == term(r, "total")
