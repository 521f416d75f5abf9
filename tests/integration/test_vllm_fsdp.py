"""vLLM rollouts with the FSDP2 actor: the two plugins together, as a user would run them.

Lives outside both plugins because neither depends on the other: this checks the seam between them
(the FSDP actor's bucketed weight stream feeding vLLM's receipted sync).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.ray]


def test_vllm_with_fsdp_actor_trains_on_the_synced_weights(tmp_path, monkeypatch):
    """A short run: every step's rollout comes from the version the FSDP actor published.

    Why short: learning is shown by the FSDP recipe test (embedded engine) and the vLLM recipe test
    (embedded actor), and the seam between the two is proven bitwise by unirl-parity-vllm's
    vLLM + FSDP gate tests. What only this test shows is the plain (parity off) seam: after each
    optimizer step the FSDP actor's bucketed stream lands in vLLM, and vLLM's sampled-token log-probs
    agree with the actor's replay of the new weights.
    """
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from unirl.api import load_config, load_kernel, train

    config = load_config(ROOT / "recipes" / "arith-tiny-vllm-fsdp.yaml",
                         [f"run.output_dir={tmp_path}", "trainer.progress=false", "trainer.plot=false",
                          "trainer.steps=4", "trainer.eval_every=0", "trainer.eval_k=1", "sft.steps=40"])
    result = train(config, load_kernel())
    steps = [h for h in result.history if h["step"] > 0]
    assert [h["version"] for h in steps] == list(range(2, config.trainer.steps + 2))
    assert all(h["grad_norm"] > 0 for h in steps), "every step moved the weights"
    assert max(h["rollout_replay_max_diff"] for h in steps) < 1e-4
