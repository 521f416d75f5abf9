"""The stream pool's invariants on real components (issue 68): the first engine error is raised only once
every launch in flight on the real engine has ended (each either whole in the buffer or failed, nothing
left on the engine); SIGTERM and Ctrl-C (SIGINT) mid-stream go through the preemption path: the step
ends, launches drain into the buffer, the checkpoint stores it, and every launched group is accounted
for (trained, stored or evicted); the resumed run trains no group twice."""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from unirl.config import RunConfig
from unirl.contracts import SamplingParams, VersionLedger
from unirl.engine.torch_engine import TorchEngine
from unirl.kernel import load_kernel
from unirl.kernel.errors import WorkerLostError
from unirl.kernel.hookspecs import hookimpl
from unirl.models.qwen3 import Qwen3Adapter
from unirl.models.tokenizer import build_demo_tokenizer
from unirl.rewards.builtin import exact_int
from unirl.rollout.batch import BatchController, EngineFailedError
from unirl.rollout.stream import StreamingController
from unirl.samples import Sample
from unirl.testing import default_runtime
from unirl.trainer.preempt import Preempted

_spec = importlib.util.spec_from_file_location("unirl_stream_rollout_tests", Path(__file__).with_name("test_stream_rollout.py"))
_stream = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_stream)
run_stream, group_of = _stream.run_stream, _stream.group_of
_stall_spec = importlib.util.spec_from_file_location("unirl_stall_timeout_tests", Path(__file__).with_name("test_stall_timeout.py"))
_stall = importlib.util.module_from_spec(_stall_spec)
_stall_spec.loader.exec_module(_stall)

CONFIG = RunConfig(model={"build": {"hidden_size": 64, "intermediate_size": 128}})


class FailingEngine(TorchEngine):
    """The torch engine, 20 ms a decode step; a job of launch ``stream-1`` fails at its second step (a lost
    worker). Every job's end (``_run`` returned or raised) is timed: the oracle for "accounted for"."""

    ended: list[tuple[str, float]] = []

    merges_jobs = False  # its _run is the point: every job runs through it (no merged batches)

    def _run(self, samples, sampling, should_stop, version):
        tag = samples[0].id.split("@", 1)[1].rsplit("/", 1)[0]
        steps = [0]

        def step() -> bool:
            steps[0] += 1
            if tag == "stream-1" and steps[0] == 2:
                raise ConnectionError("decode worker lost")
            time.sleep(0.02)
            return should_stop()

        try:
            super()._run(samples, sampling, step, version)
        finally:
            FailingEngine.ended.append((tag, time.monotonic()))


def test_the_first_engine_error_is_raised_once_every_launch_on_the_engine_has_ended():
    tok = build_demo_tokenizer()
    engine = FailingEngine(config=CONFIG, runtime=default_runtime(CONFIG), adapter=Qwen3Adapter(), tokenizer=tok)
    ctl = BatchController(config=CONFIG, engine=engine, tokenizer=tok, reward_fn=exact_int, base_seed=0)
    lock, drawn = threading.Lock(), [0]

    def draw(k: int) -> list[Sample]:
        with lock:
            drawn[0] += 1
            return [Sample(id=f"p{drawn[0]}", prompt_ids=tok.encode(f"Q: {drawn[0]}+1=? A:"), answer=drawn[0] + 1)]

    p = StreamingController(ctl, engine, VersionLedger(), collect_group=lambda tag: ctl.collect(
        draw, groups=1, n=2, sampling=SamplingParams(max_new_tokens=12, ignore_eos=True), launch_tag=tag),
        slots=3, max_staleness=1, stall_timeout_s=60.0, engine_name="torch", buffer_cap=8)
    FailingEngine.ended.clear()
    try:
        with pytest.raises(EngineFailedError, match=r"rollout engine 'torch' failed launch stream-1 .*decode worker lost"):
            p.take(6)
        raised = time.monotonic()
        ended = dict(FailingEngine.ended)
        assert {"stream-0", "stream-1", "stream-2"} <= ended.keys()
        assert max(ended["stream-0"], ended["stream-2"]) > ended["stream-1"]  # some ran on after launch 1 failed
        assert max(ended.values()) <= raised  # raised only after every launch's job ended
        assert p.in_flight == 0 and engine.in_flight == 0  # nothing left running or unreaped on the engine
        launches = sorted(g.launch for g in p._buffer)
        assert 1 not in launches and {0, 2} <= set(launches)  # the failed launch inserted nothing
        for g in p._buffer:  # the others are whole: both samples, every token decoded
            assert [len(s.response_ids) for s in g.samples] == [12, 12]
    finally:
        p.close()
        engine.close()


class Signal:
    """Sends ``signum`` to this process when step ``at``'s batch is handed to the trainer."""

    def __init__(self, signum: int, at: int = 1) -> None:
        self.signum, self.at, self.sent = signum, at, 0

    @hookimpl
    def unirl_on_rollout(self, phase, step, samples):
        if phase == "train" and step == self.at and not self.sent:
            self.sent = 1
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_stream_drains_checkpoints_and_the_resume_trains_no_group_twice(tmp_path, signum):
    sig, before, kernel = Signal(signum), _stream.TrainedGroups(), load_kernel()
    kernel.register(sig, entry_point="signal", dist="test-signal", version="0")
    kernel.register(before, entry_point="trained-before", dist="test-trained-before", version="0")
    with pytest.raises(Preempted) as err:
        run_stream(tmp_path, "p", "trainer.steps=4", "trainer.save_every=0", kernel=kernel)
    assert err.value.exit_code == (143 if signum == signal.SIGTERM else 130) and sig.sent
    assert "preempted at step 2" in str(err.value)
    saved = tmp_path / "p" / "checkpoints" / "step_000002"
    stored = torch.load(saved / "extra.pt", weights_only=False)["trainer"]["controller"]["stream"]
    trained = Counter(group_of(s) for ss in before.steps.values() for s in ss)
    assert sorted(before.steps) == [0, 1] and len(trained) == 8 and set(trained.values()) == {4}
    kept = [group_of(x[0]) for _, x, _ in stored["buffer"]]
    assert all(len(x) == 4 for _, x, _ in stored["buffer"]) and len(set(kept)) == len(kept)
    assert not set(kept) & trained.keys()
    # every group launched before the save is accounted for: trained, stored whole, or evicted (counted)
    assert stored["next"] == len(trained) + len(kept) + stored["evicted_total"]
    resumed, spy2 = run_stream(tmp_path, "p", "trainer.steps=4", "trainer.save_every=0", "run.resume=true")
    assert sorted(spy2.steps) == [2, 3]
    after = Counter(group_of(s) for ss in spy2.steps.values() for s in ss)
    assert set(after.values()) == {4}  # whole groups, each once
    launch = [int(g.rsplit("stream-", 1)[1]) for g in after]
    assert all(g in kept or k >= stored["next"] for g, k in zip(after, launch, strict=True))
    assert not after.keys() & trained.keys()  # no group trained twice across the preemption


def test_decoding_share_is_what_the_engine_runs_not_what_it_holds(tmp_path):
    """``stream/decoding`` (the engine's request-seconds decoding, RolloutEngine.progress().busy_s) against
    ``stream/occupancy`` (requests held): the engine never decodes more than it holds, and it decodes in
    some step. (That queued launches decode together, unirl.engine.merged, is checked on the engine itself:
    test_merged_batching.py; here the backpressure keeps few launches held at once, so the share says little.)"""
    result, _ = run_stream(tmp_path, "d", "trainer.steps=4", "rollout.max_new_tokens=16")
    rows = [h for h in result.history if h.get("step", 0) >= 1]
    for h in rows:
        assert 0.0 <= h["stream/decoding"] <= h["stream/occupancy"] + 1e-6, h  # 0: the buffer was full
    assert max(h["stream/decoding"] for h in rows) > 0.0


def test_on_sync_abort_restarts_running_requests_under_the_new_weights(tmp_path):
    """``rollout.stream.on_sync: abort``: the requests running at a sync stop, lose their partial turn and
    start over under the new weights (counted in ``stream/restarted_requests``); the pool's invariants hold:
    whole groups, each trained once, one version per sample, within ``max_staleness``. At 1: at 0 nothing
    launches while the trainer trains (``held_ceiling``), so nothing runs at a sync to restart."""
    hang = _stall.HangingEngine  # the torch engine, 10 ms a decode step (no hang): a launch outlasts a train
    hang.release.clear()  # step, so one runs at every sync whatever the machine's speed (on a quiet machine
    hang.times, hang.step_sleep_s, hang.hang_launch = 0, 0.01, ""  # the plain engine finished them all first)
    try:
        result, spy = run_stream(tmp_path, "ab", "trainer.steps=4", "rollout.max_new_tokens=48",
                                 "rollout.stream.on_sync=abort", "rollout.max_staleness=1",
                                 "rollout.engine=torch-hang", kernel=_stall.kernel())
    finally:
        hang.step_sleep_s = 0.0
    rows = [h for h in result.history if h.get("step", 0) >= 1]
    assert sum(h["stream/restarted_requests"] for h in rows) > 0, [h["stream/restarted_requests"] for h in rows]
    seen: Counter[str] = Counter()
    for samples in spy.steps.values():
        sizes = Counter(group_of(s) for s in samples)
        assert set(sizes.values()) == {4}
        seen.update(sizes.keys())
        for s in samples:
            assert s.meta["staleness"] <= 1 and len(set(s.versions)) == 1 and len(s.requests) == 1
    assert max(seen.values()) == 1


class DyingEngine(TorchEngine):
    """The torch engine (registered as ``torch-dies``); the job of launch ``stream-6`` loses its worker at
    its second decode step, once: a killed engine whose restarted run decodes again."""

    name = "torch-dies"
    lives = [1]
    merges_jobs = False  # its _run is the point: every job runs through it

    def _run(self, samples, sampling, should_stop, version):
        die = "@stream-6/" in samples[0].id and self.lives[0] > 0
        steps = [0]

        def step() -> bool:
            steps[0] += 1
            if die and steps[0] == 2:
                self.lives[0] -= 1
                raise ConnectionError("decode worker killed")
            return should_stop()

        super()._run(samples, sampling, step, version)


class DyingPlugin:
    @hookimpl
    def unirl_rollout_engines(self):
        return {"torch-dies": DyingEngine}


def test_a_killed_engine_fails_the_stream_naming_it_and_the_restarted_run_continues(tmp_path):
    """A stream run whose engine loses a worker mid-launch fails that step with ``EngineFailedError`` naming
    the engine and the launch (a restartable ``WorkerLostError``); ``run.max_restarts`` resumes it from the
    last checkpoint (the drained, stored buffer) and the run finishes, training no group twice or partly."""
    DyingEngine.lives[0] = 1
    kernel = load_kernel()
    kernel.register(DyingPlugin(), entry_point="torch-dies", dist="test-torch-dies", version="0")
    result, spy = run_stream(tmp_path, "k", "rollout.engine=torch-dies", "trainer.steps=3", "trainer.save_every=1",
                             "run.max_restarts=1", kernel=kernel)
    assert DyingEngine.lives[0] == 0 and result.restarts == 1 and result.steps_done == 3
    log = (tmp_path / "k" / "restarts.log").read_text()
    assert "EngineFailedError" in log and "rollout engine 'torch-dies' failed launch stream-6" in log, log
    assert sorted(spy.steps) == [0, 1, 2]
    trained = Counter(group_of(s) for ss in spy.steps.values() for s in ss)
    assert set(trained.values()) == {4}  # whole groups of rollout.n, each trained once over both attempts
    assert not any("@stream-6/" in g for g in trained)  # the failed launch never reached the trainer


def test_a_hung_decode_fails_the_stream_run_within_the_stall_timeout(tmp_path):
    """The embedded engine's decode blocks mid-generation (test_stall_timeout's ``torch-hang`` engine) in a
    stream run: the step fails with ``EngineStalledError`` within ``rollout.stall_timeout_s`` (plus the
    engine's close wait), naming the engine and the hung launch, as a restartable ``WorkerLostError``."""
    from unirl.rollout.stall import EngineStalledError

    hang = _stall.HangingEngine
    hang.release.clear()
    hang.hung_at.clear()
    hang.times, hang.step_sleep_s, hang.hang_launch = 1, 0.0, "stream-6"
    try:
        with pytest.raises(EngineStalledError) as err:
            run_stream(tmp_path, "h", "rollout.engine=torch-hang", "trainer.steps=4", "rollout.stall_timeout_s=1.5",
                       "rollout.max_new_tokens=8", kernel=_stall.kernel())
        failed = time.monotonic()
    finally:
        hang.release.set()
        hang.hang_launch = ""
    assert len(hang.hung_at) == 1 and failed - hang.hung_at[0] < 1.5 + hang.close_wait_s + 4.0
    msg = str(err.value)
    assert "rollout engine 'torch-hang' made no progress for rollout.stall_timeout_s=1.5 s" in msg
    assert "stream-6" in msg and "@stream-6/" in msg and "\n" not in msg  # the launch and its requests
    assert isinstance(err.value, WorkerLostError)
