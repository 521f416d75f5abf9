"""End to end on the embedded path: torch engine + torch actor, GRPO, the gate on every micro-batch.

``recipes/parity-tiny-embedded.yaml`` as written: zero mismatches over >= 2,048 selected tokens at
``initial_checkpoint`` and again at ``post_update_reload`` after 2 optimizer steps; and a negative
run where one engine-side weight is perturbed: the gate stops the first step before backward.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from unirl.api import load_config, load_kernel, train
from unirl_parity_vllm.gate import ParityMismatchError

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "parity-tiny-embedded.yaml"


@pytest.fixture
def parity_env(monkeypatch):
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    monkeypatch.delenv("UNIRL_PARITY_DIR", raising=False)


@pytest.mark.slow
@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
def test_embedded_grpo_is_bitwise_on_policy(tmp_path, parity_env):
    config = load_config(str(RECIPE), [f"run.output_dir={tmp_path}", "trainer.progress=false", "trainer.plot=false"])
    result = train(config, load_kernel())
    assert result.steps_done == 3
    doc = json.loads((config.run_dir / "parity" / "artifact.json").read_text())
    init, post = doc["phases"]["initial_checkpoint"], doc["phases"]["post_update_reload"]
    assert init["tokens"] >= 2048 and init["mismatches"] == 0 and init["max_abs_diff"] == 0.0
    assert init["weight_versions"] == [1]
    assert post["tokens"] >= 2048 and post["mismatches"] == 0 and post["max_abs_diff"] == 0.0
    assert post["max_optimizer_steps_before"] == 2 and 3 in post["weight_versions"]
    assert doc["verdict"] == "pass" and doc["skipped_updates"] == 0
    assert init["micro_batches"] + post["micro_batches"] >= 3 * 2  # every micro-batch was gated
    assert result.history[-1]["parity_post_update_mismatches"] == 0


@pytest.mark.slow
@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
def test_engine_side_perturbation_fails_before_backward(tmp_path, parity_env, monkeypatch):
    from unirl.actor.torch_actor import TorchActor
    from unirl.engine.torch_engine import TorchEngine

    load = TorchEngine.load_weights

    def perturbed(self, staged, version):
        out = load(self, staged, version)
        with torch.no_grad():
            self.model.model.layers[0].mlp.down_proj.weight[3, 5] += 1e-3  # engine side only
        return out

    monkeypatch.setattr(TorchEngine, "load_weights", perturbed)
    actors = []
    init = TorchActor.__init__

    def capture(self, *a, **kw):
        init(self, *a, **kw)
        actors.append((self, {k: v.detach().clone() for k, v in self.model.state_dict().items()}))

    monkeypatch.setattr(TorchActor, "__init__", capture)
    config = load_config(str(RECIPE), [f"run.output_dir={tmp_path}", "trainer.progress=false", "trainer.plot=false"])
    with pytest.raises(ParityMismatchError) as err:
        train(config, load_kernel())
    assert "initial_checkpoint" in str(err.value) and err.value.stats["mismatches"] > 0
    actor, before = actors[0]
    assert actor.step == 0  # no optimizer step was taken
    after = actor.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # parameters unchanged
    assert all(p.grad is None for p in actor.model.parameters())  # no backward ran
    rec = json.loads((config.run_dir / "parity" / "gate-rank0.json").read_text())
    assert rec["phases"]["initial_checkpoint"]["failed"] == 1
