"""The async trainer (rollout.mode: async) end to end on the embedded engine: on-policy at staleness 0,
the async metrics, preflight of the async keys, and an engine killed mid-rollout then a resume."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from unirl.config import load_config
from unirl.engine.torch_engine import TorchEngine
from unirl.kernel import load_kernel
from unirl.kernel.errors import PreflightError
from unirl.kernel.hookspecs import hookimpl
from unirl.preflight import preflight
from unirl.rollout.batch import EngineFailedError
from unirl.trainer.loop import train

ROOT = Path(__file__).resolve().parents[2]
SMALL = [  # test_trainer.py's small run
    "sft.steps=20", "sft.batch_size=16", "trainer.steps=6", "trainer.prompts_per_step=4",
    "trainer.eval_every=0", "trainer.progress=false", "trainer.plot=false", "data.arith.n_train=64",
    "data.arith.n_eval=8", "rollout.n=4", "rollout.max_new_tokens=4", "model.build={hidden_size: 64, intermediate_size: 128}",
]


def small_config(tmp_path, name, *extra):
    return load_config(ROOT / "recipes" / "arith-tiny.yaml", [*SMALL, f"run.output_dir={tmp_path}", f"run.name={name}", *extra])

ASYNC_METRICS = {"staleness_mean", "staleness_max", "publish_lag_s", "trainer_idle_frac", "engine_idle_frac",
                 "inflight_launches", "version"}


class RatioSpy:
    """Before every backward: the PPO ratio pi_theta / pi_behaviour (engine log-probs) on update 0."""

    def __init__(self) -> None:
        self.dev: dict[int, float] = {}

    @hookimpl
    def unirl_before_backward(self, ctx):
        if ctx.update == 0 and ctx.logprobs.numel():
            d = float((ctx.logprobs.double() - ctx.rollout_logprobs.double()).exp().sub(1).abs().max())
            self.dev[ctx.rl_step] = max(self.dev.get(ctx.rl_step, 0.0), d)


class ParityReward:
    """Reward = parity of the sampled token ids' sum: every group has spread, so every step moves the weights."""

    @hookimpl
    def unirl_rewards(self):
        return {"token-parity": lambda completion, sample: float(sum(sample.response_ids) % 2)}


def run_with_spy(tmp_path, name, *extra):
    spy, kernel = RatioSpy(), load_kernel()
    kernel.register(spy, entry_point="ratio-spy", dist="test-ratio-spy", version="0")
    kernel.register(ParityReward(), entry_point="parity-reward", dist="test-parity-reward", version="0")
    result = train(small_config(tmp_path, name, "rollout.mode=async", "trainer.steps=3", "sft.steps=0",
                                "reward.name=token-parity", "actor.lr=3e-3", *extra), kernel)
    return result, spy


#: the parity provider (unirl-parity-vllm, installed with the dev stack) makes the engine's decode and the
#: actor's training forward bitwise equal, so what remains of the ratio is staleness alone
PARITY = ["plugins.parity={enabled: true, dtype: float32, weight_sync: inprocess, logprobs_mode: raw_logprobs, "
          "topology: {actor: torch, actor_ranks: 1, engine: torch}}", "algorithm.updates_per_batch=1"]


@pytest.mark.slow
def test_staleness_zero_is_on_policy_and_staleness_one_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    monkeypatch.delenv("UNIRL_PARITY_DIR", raising=False)
    on, spy = run_with_spy(tmp_path, "s0", "rollout.max_staleness=0", "rollout.weight_sync_interval=1", *PARITY)
    monkeypatch.delenv("UNIRL_PARITY_ENABLE")
    assert sorted(spy.dev) == [0, 1, 2]
    assert max(spy.dev.values()) < 1e-6, spy.dev  # every batch's first-update PPO ratio is 1
    rows = [json.loads(x) for x in (tmp_path / "s0" / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(ASYNC_METRICS <= set(r) for r in rows)
    assert [r["staleness_max"] for r in rows] == [0, 0, 0] and [r["version"] for r in rows] == [2, 3, 4]
    assert all(0.0 <= r["trainer_idle_frac"] <= 1.0 and 0.0 <= r["engine_idle_frac"] <= 1.0 for r in rows)

    # the oracle's contrast: one step off, the second and third batches come from the previous weights
    off, spy1 = run_with_spy(tmp_path, "s1", "rollout.max_staleness=1")
    assert [h["staleness_max"] for h in off.history[1:]] == [0, 1, 1]
    assert spy1.dev[0] < 1e-6 and max(spy1.dev[1], spy1.dev[2]) > 1e-4, spy1.dev
    assert not math.isnan(off.eval_after)


class DyingEngine(TorchEngine):
    """The embedded engine, killed (its generation raises) a few decode steps into launch ``KILL_TAG``."""

    name = "torch-dying"
    KILL_TAG = "@train-4/"
    killed_at: float | None = None

    merges_jobs = False  # its _run is the point: every job runs through it (no merged batches)

    def _run(self, samples, sampling, should_stop, version):
        if not any(self.KILL_TAG in s.id for s in samples):
            return super()._run(samples, sampling, should_stop, version)
        steps = 0

        def dying_stop():
            nonlocal steps
            steps += 1
            if steps > 2:
                DyingEngine.killed_at = time.monotonic()
                raise ConnectionError("engine worker process exited (SIGKILL)")
            return should_stop()

        return super()._run(samples, sampling, dying_stop, version)


class Dying:
    scored: list[str] = []

    @hookimpl
    def unirl_rollout_engines(self):
        return {"torch-dying": DyingEngine}

    @hookimpl
    def unirl_on_rollout(self, phase, samples):
        if phase == "train":
            Dying.scored.extend(s.id for s in samples)


@pytest.mark.slow
def test_engine_killed_mid_rollout_fails_naming_it_and_a_resume_continues(tmp_path):
    kernel = load_kernel()
    kernel.register(Dying(), entry_point="dying", dist="test-dying", version="0")
    args = ["rollout.mode=async", "rollout.max_staleness=1", "trainer.steps=5", "trainer.save_every=2",
            "sft.steps=0"]
    with pytest.raises(EngineFailedError, match="rollout engine 'torch-dying' failed launch train-4") as info:
        train(small_config(tmp_path, "kill", "rollout.engine=torch-dying", *args), kernel)
    assert time.monotonic() - DyingEngine.killed_at < 30  # surfaced within a bounded time
    assert "SIGKILL" in str(info.value) and "run.resume=true" in str(info.value)
    assert not any("@train-4/" in sid for sid in Dying.scored)  # nothing of the killed launch was consumed
    root = tmp_path / "kill" / "checkpoints"
    # nothing is prefetched across a scheduled checkpoint: step 4's collect started after step 4's save
    assert (root / "latest").read_text().strip() == "step_000004"

    resumed = train(small_config(tmp_path, "kill", "run.resume=true", *args), load_kernel())
    assert resumed.steps_done == 5
    assert [h["step"] for h in resumed.history] == [0, 1, 2, 3, 4, 5]
    assert (root / "latest").read_text().strip() == "step_000005"


def test_preflight_validates_the_async_keys(tmp_path):
    kernel = load_kernel()
    base = ROOT / "recipes" / "arith-tiny.yaml"

    def fields(*overrides):
        return {v.field for v in preflight(load_config(base, list(overrides)), kernel)}

    assert fields("rollout.max_staleness=2") == {"rollout.max_staleness"}  # ignored in sync mode: refused
    assert fields("rollout.mode=async", "rollout.max_staleness=2") == set()
    with pytest.raises(Exception, match="rollout.max_inflight was removed.*remove rollout.max_inflight"):
        load_config(base, ["rollout.mode=async", "rollout.max_inflight=2"])  # one collect is in flight
    assert fields("rollout.mode=async", "algorithm.dynamic_sampling.enabled=true") == {
        "algorithm.dynamic_sampling.enabled"}
    with pytest.raises(Exception, match="max_staleness"):
        load_config(base, ["rollout.max_staleness=-1"])
    with pytest.raises(PreflightError, match="rollout.weight_sync_interval"):
        train(small_config(tmp_path, "bad", "rollout.weight_sync_interval=2"), kernel)
    assert not (tmp_path / "bad").exists()  # refused before the run directory is made
