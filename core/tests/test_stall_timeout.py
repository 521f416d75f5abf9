"""rollout.stall_timeout_s in every mode (issue 68): a hung engine fails the run within the timeout, naming
the engine, the launch and its requests, as a restartable error; a long generation that keeps decoding is
not a stall. The hung engine is the embedded torch engine, subclassed by a plugin registered through the
kernel, whose decode loop blocks after a few steps (a decode step that never returns)."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import pytest

from unirl.config import RunConfig
from unirl.contracts import SamplingParams
from unirl.engine.torch_engine import TorchEngine
from unirl.kernel import load_kernel
from unirl.kernel.errors import WorkerLostError
from unirl.kernel.hookspecs import hookimpl
from unirl.models.qwen3 import Qwen3Adapter
from unirl.models.tokenizer import build_demo_tokenizer
from unirl.rollout.stall import EngineStalledError, watched
from unirl.runtime import build_runtime
from unirl.samples import Sample
from unirl.trainer.components import build_engine
from unirl.trainer.loop import train

_spec = importlib.util.spec_from_file_location("unirl_async_trainer_tests", Path(__file__).with_name("test_async_trainer.py"))
_async = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_async)
small_config = _async.small_config


class HangingEngine(TorchEngine):
    """The torch engine; a job holding a sample of launch ``hang_launch`` blocks in its third decode step
    until the test releases it (``times`` such jobs hang; later ones decode). ``step_sleep_s`` slows every
    decode step (a long generation that still makes progress)."""

    name = "torch-hang"
    close_wait_s = 1.0  # close() leaves the hung job behind after this (the default waits 10 s)
    hang_launch, times, step_sleep_s = "", 1, 0.0
    release = threading.Event()
    hung_at: list[float] = []

    merges_jobs = False  # its _run is the point: every job runs through it (no merged batches)

    def _run(self, samples, sampling, should_stop, version):
        cls = type(self)
        hang = cls.hang_launch and any(f"@{cls.hang_launch}/" in s.id for s in samples) and cls.times > 0
        if hang:
            cls.times -= 1
        steps = [0]

        def step() -> bool:
            steps[0] += 1
            if hang and steps[0] == 3:
                cls.hung_at.append(time.monotonic())
                cls.release.wait()  # never returns while the test runs: the engine is hung mid-decode
            time.sleep(cls.step_sleep_s)
            return should_stop()

        super()._run(samples, sampling, step, version)


class Plugin:
    @hookimpl
    def unirl_rollout_engines(self):
        return {"torch-hang": HangingEngine}


@pytest.fixture
def hang():
    HangingEngine.release.clear()
    HangingEngine.hung_at.clear()
    HangingEngine.times, HangingEngine.step_sleep_s = 1, 0.0
    yield HangingEngine
    HangingEngine.release.set()  # the left-behind decode thread ends with the test
    HangingEngine.hang_launch = ""


def kernel():
    k = load_kernel()
    k.register(Plugin(), entry_point="torch-hang", dist="test-torch-hang", version="0")
    return k


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_hung_engine_fails_the_step_within_the_stall_timeout(tmp_path, hang, mode):
    hang.hang_launch = "train-2"
    extra = ["rollout.max_staleness=1"] if mode == "async" else []
    cfg = small_config(tmp_path, mode, f"rollout.mode={mode}", "rollout.engine=torch-hang", "sft.steps=0",
                       "trainer.steps=4", "rollout.stall_timeout_s=1.5", "rollout.max_new_tokens=8", *extra)
    with pytest.raises(EngineStalledError) as err:
        train(cfg, kernel())
    failed = time.monotonic()
    # the stall timeout plus the engine's close wait (the run closes its components before it raises)
    assert len(hang.hung_at) == 1 and failed - hang.hung_at[0] < 1.5 + hang.close_wait_s + 4.0
    msg = str(err.value)
    assert "rollout engine 'torch-hang' made no progress for rollout.stall_timeout_s=1.5 s" in msg
    assert "launches train-2 in flight" in msg and "@train-2/0" in msg  # the launch and its requests
    assert "run.resume=true" in msg and "\n" not in msg
    assert isinstance(err.value, WorkerLostError)  # restartable


def test_a_hung_engine_fails_an_eval_within_the_stall_timeout(tmp_path, hang):
    """The held-out eval's collect is watched like a train collect (it used to wait forever)."""
    hang.hang_launch = "eval-0"
    cfg = small_config(tmp_path, "eval", "rollout.engine=torch-hang", "sft.steps=0", "trainer.steps=1",
                       "rollout.stall_timeout_s=1.5", "rollout.max_new_tokens=8")
    with pytest.raises(EngineStalledError) as err:
        train(cfg, kernel())
    assert len(hang.hung_at) == 1 and time.monotonic() - hang.hung_at[0] < 1.5 + hang.close_wait_s + 4.0
    assert "launches eval-0 in flight" in str(err.value) and "@eval-0/" in str(err.value)


def test_a_stalled_run_restarts_from_its_checkpoint_and_finishes(tmp_path, hang):
    hang.hang_launch = "train-2"  # hangs once; the restarted attempt decodes it
    cfg = small_config(tmp_path, "restart", "rollout.engine=torch-hang", "sft.steps=0", "trainer.steps=3",
                       "trainer.save_every=1", "run.max_restarts=1", "rollout.stall_timeout_s=1.5")
    result = train(cfg, kernel())
    assert result.restarts == 1 and result.steps_done == 3
    log = (tmp_path / "restart" / "restarts.log").read_text()
    assert "EngineStalledError" in log and "torch-hang" in log


def test_a_slow_generation_that_keeps_decoding_is_not_a_stall(hang):
    """Progress is the engine's decode steps (RolloutEngine.progress), not the collect's length: 40 steps of
    50 ms take 2 s, four times the timeout, and pass; the same engine hung mid-decode fails in ~0.5 s."""
    tok, k, config = build_demo_tokenizer(), kernel(), RunConfig(rollout={"engine": "torch-hang"})
    engine = build_engine(config, k, adapter=Qwen3Adapter(), tokenizer=tok,
                          runtime=build_runtime(config, k, adapter=Qwen3Adapter()))
    try:
        def gen(tag: str):
            ss = [Sample(id=f"q@{tag}/{i}", prompt_ids=tok.encode("Q: 1+2=? A:"), seed=i) for i in range(2)]
            return lambda: engine.generate(ss, SamplingParams(max_new_tokens=40, ignore_eos=True))

        hang.step_sleep_s = 0.05
        t0 = time.monotonic()
        out = watched(gen("slow"), engine=engine, engine_name="torch-hang", timeout_s=0.5, launch="slow")
        assert time.monotonic() - t0 > 1.5 and all(len(s.response_ids) == 40 for s in out)
        hang.hang_launch, hang.step_sleep_s = "hung", 0.0
        t0 = time.monotonic()
        with pytest.raises(EngineStalledError, match=r"launches hung in flight, requests q@hung/0, q@hung/1 on"):
            watched(gen("hung"), engine=engine, engine_name="torch-hang", timeout_s=0.5, launch="hung")
        assert time.monotonic() - t0 < 0.5 + 2.0
        assert engine.progress().requests == ("q@hung/0", "q@hung/1")
    finally:
        t0 = time.monotonic()
        engine.close()  # the hung job is left behind after close_wait_s, not waited on forever
        assert time.monotonic() - t0 < engine.close_wait_s + 5


def test_a_hung_reward_with_the_engine_idle_is_named_as_the_controller_s_own_work():
    """The whole collect is watched, scoring included (it runs off the main thread, as in async mode): a
    collect whose engine is idle and which never returns is a stall too, and the message says the engine
    holds no request."""
    from unirl.testing import default_runtime

    config = RunConfig(model={"build": {"hidden_size": 64, "intermediate_size": 128}})
    engine = TorchEngine(config=config, runtime=default_runtime(config), adapter=Qwen3Adapter(),
                         tokenizer=build_demo_tokenizer())
    gate = threading.Event()
    try:
        with pytest.raises(EngineStalledError, match=r"launches train-5 in flight, 0 request\(s\) on the engine "
                                                     r"\(the engine holds none: the controller's own work"):
            watched(lambda: gate.wait(30), engine=engine, engine_name="torch", timeout_s=0.5, launch="train-5")
    finally:
        gate.set()
        engine.close()
