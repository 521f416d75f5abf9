"""vLLM rollouts with the FSDP2 actor: the two plugins together, as a user would run them.

Lives outside both plugins because neither depends on the other: this checks the seam between them
(the FSDP actor's bucketed weight stream feeding vLLM's receipted sync).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.ray]


def test_vllm_with_fsdp_actor_learns(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from unirl.config import load_config
    from unirl.kernel import load_kernel
    from unirl.trainer.loop import train

    config = load_config(ROOT / "recipes" / "arith-tiny-vllm-fsdp.yaml",
                         [f"run.output_dir={tmp_path}", "trainer.progress=false", "trainer.plot=false"])
    result = train(config, load_kernel())
    steps = [h for h in result.history if h["step"] > 0]
    assert [h["version"] for h in steps] == list(range(2, config.trainer.steps + 2))
    assert max(h["rollout_replay_max_diff"] for h in steps) < 1e-4
    print(f"vLLM + FSDP avg@4 before {result.eval_before:.3f} after {result.eval_after:.3f}")
    assert result.eval_after > result.eval_before + 0.05
