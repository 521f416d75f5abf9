"""A vLLM replica (its Ray actor) killed in the middle of a weight sync, on the real trainer (issue 40):
the ledger keeps the old version and the run fails with a named, restartable error that resumes cleanly;
with ``run.max_restarts: 1`` the trainer rebuilds the engine itself and finishes the run."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "arith-tiny-vllm.yaml"
ARGS = ["sft.steps=0", "trainer.steps=3", "trainer.prompts_per_step=4", "trainer.eval_every=0",
        "trainer.progress=false", "trainer.plot=false", "trainer.export_hf=false", "trainer.save_every=1",
        "data.arith.n_train=64", "data.arith.n_eval=4", "trainer.eval_k=2", "rollout.n=4",
        "rollout.options={placement: ray, ray_num_cpus: 1, kv_cache_gb: 0.25, max_model_len: 128}"]


@pytest.fixture(autouse=True)
def own_ray():
    """The engine starts Ray in this process (placement: ray); later modules call ``ray.init`` themselves."""
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def kill_in_sync(monkeypatch):
    """Kills the replica's Ray actor as the sync of version 3 starts (the publish after step 2)."""
    import ray

    from unirl_vllm.engine import VLLMEngine

    real, killed = VLLMEngine._sync_all, []

    def sync_all(self, version, manifest, tensors):
        if version == 3 and not killed:
            killed.append(version)
            ray.kill(self._hosts[0]._actor, no_restart=True)
        return real(self, version, manifest, tensors)

    monkeypatch.setattr(VLLMEngine, "_sync_all", sync_all)
    return killed


def test_a_replica_lost_mid_sync_keeps_the_old_version_and_resumes_cleanly(require_vllm, tmp_path, kill_in_sync):
    import torch

    from unirl.api import WorkerLostError, load_config, load_kernel
    from unirl.kernel.errors import WeightSyncError
    from unirl.trainer.loop import train

    config = load_config(RECIPE, [*ARGS, f"run.output_dir={tmp_path}", "run.name=r"])
    with pytest.raises(WeightSyncError) as err:
        train(config, load_kernel())
    assert isinstance(err.value, WorkerLostError) and kill_in_sync == [3]
    assert "weight sync to version 3 failed" in str(err.value) and "vllm replica 0" in str(err.value)
    latest = config.run_dir / "checkpoints" / "step_000001"
    assert not (config.run_dir / "checkpoints" / "step_000002").exists()
    state = torch.load(latest / "extra.pt", weights_only=False)["trainer"]
    assert state["version"] == 2  # the ledger never committed version 3
    resumed = train(load_config(RECIPE, [*ARGS, f"run.output_dir={tmp_path}", "run.name=r", "run.resume=true"]),
                    load_kernel())
    assert resumed.steps_done == 3 and resumed.history[-1]["version"] == 4


def test_max_restarts_rebuilds_the_engine_and_finishes(require_vllm, tmp_path, kill_in_sync):
    from unirl.api import load_config, load_kernel
    from unirl.trainer.loop import train

    config = load_config(RECIPE, [*ARGS, f"run.output_dir={tmp_path}", "run.name=r", "run.max_restarts=1"])
    result = train(config, load_kernel())
    assert kill_in_sync == [3] and result.restarts == 1 and result.steps_done == 3
    assert result.history[-1]["version"] == 4 and [h["step"] for h in result.history] == [0, 1, 2, 3]
    assert "ReplicaLostInSync" in (config.run_dir / "restarts.log").read_text()
