"""Each FSDP rank reports its own per-phase peak memory (issue 65 item 4: ``Actor.memory_peaks``, answered by
:mod:`unirl_fsdp.memory` in each rank's process), and the trainer puts them in every step's row.

The oracle: rank 1 runs a worker that holds a known 300 MB ballast through each ``train_step`` and does
nothing else differently, so rank 1's train peak must stand that far above its own replay peak of the same
step and above rank 0's train peak. Swapped ranks, a driver-side reading, or a mark never reset would fail.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("CI") != "true":  # in CI a missing Ray fails the test
    pytest.importorskip("ray")
import torch  # noqa: E402

from unirl.api import load_config, load_kernel, train  # noqa: E402
from unirl_fsdp.worker import FSDPWorker  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
BALLAST_MB = 300


class BallastWorker(FSDPWorker):
    """Rank 1 holds BALLAST_MB (touched) for the whole of every train_step."""

    def train_step(self, *args: Any) -> Any:
        if self.rank != 1:
            return super().train_step(*args)
        ballast = torch.ones(BALLAST_MB * (1 << 20) // 4)
        try:
            return super().train_step(*args)
        finally:
            del ballast


def test_each_rank_reports_its_own_phase_peaks(ray_session, tmp_path):
    config = load_config(ROOT / "recipes" / "arith-tiny-fsdp.yaml", [
        "sft.steps=0", "trainer.steps=2", "trainer.prompts_per_step=2", "trainer.eval_every=0",
        "trainer.progress=false", "trainer.plot=false", "trainer.save_every=1", "data.arith.n_train=16",
        "data.arith.n_eval=2", "trainer.eval_k=1", "rollout.n=2", "rollout.max_new_tokens=2",
        "model.build={hidden_size: 32, intermediate_size: 64}", f"run.output_dir={tmp_path}",
        "actor.options={world_size: 2, cpus_per_rank: 0.5, threads_per_rank: 1, "
        "worker_cls: 'test_memory_peaks_fsdp:BallastWorker'}"])
    result = train(config, load_kernel())
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"mem/load_peak_mb_rank0", "mem/load_peak_mb_rank1"} <= set(rows[0])
    step1 = next(r for r in rows if r["step"] == 1)
    for name in ("rollout", "replay", "train", "sync"):
        ranks = [step1[f"mem/{name}_peak_mb_rank{k}"] for k in (0, 1)]
        assert all(100 < mb < 8192 for mb in ranks), (name, ranks)  # a process holding torch and a shard
        assert step1[f"mem/{name}_peak_mb_ranks_sum"] == pytest.approx(sum(ranks), abs=0.2)
    assert step1["mem/train_peak_mb_rank1"] >= step1["mem/replay_peak_mb_rank1"] + BALLAST_MB * 0.9
    assert step1["mem/train_peak_mb_rank1"] >= step1["mem/train_peak_mb_rank0"] + BALLAST_MB * 0.7
    assert "mem/checkpoint_peak_mb_rank1" in next(r for r in rows if r["step"] == 2)
    doc = json.loads((result.run_dir / "memory.json").read_text())
    assert len(doc["phases"]["export"]["ranks_rss_mb"]) == 2
