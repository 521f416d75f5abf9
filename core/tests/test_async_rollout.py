"""Contract tests of the async rollout mechanism (unirl.rollout): every invariant of issue 11, on CPU.

The pool and controller run on a scripted engine built on the real ``QueuedEngine`` base (its submit /
poll / abort / in-flight bookkeeping and sync guard are the ones every engine uses), so each test can
hold a generation open, fail it or stall it at a chosen point. The last tests drive the real embedded
torch engine and its in-process weight sync through the same controller.
"""

from __future__ import annotations

import threading
import time

import pytest

from unirl.contracts import EngineCapabilities, Receipt, SamplingParams, VersionLedger, WeightSync
from unirl.engine.queued import QueuedEngine
from unirl.kernel.errors import SyncRefusedError
from unirl.rollout.buffer import StaleVersionError, VersionedBuffer
from unirl.rollout.controller import BatchRolloutController
from unirl.rollout.pool import EngineFailedError, InflightPool
from unirl.samples import Sample, expand
from unirl.trainer.drivers import next_drained

SAMPLING = SamplingParams(max_new_tokens=3)


class ScriptedEngine(QueuedEngine):
    """Appends ``len(prompt)`` tokens per turn. ``gate`` (when set) holds every job until it is set;
    ``fail_on`` names gen tags whose job raises mid-generation (a killed engine); ``hang`` never finishes."""

    name = "scripted"

    def __init__(self) -> None:
        super().__init__()
        self.gate: threading.Event | None = None
        self.fail_on: set[str] = set()
        self.hang = False
        self.loads: list[int] = []

    @classmethod
    def capabilities(cls, config):
        return EngineCapabilities(weight_syncs=("scripted",))

    def _run(self, samples, sampling, should_stop, version):
        if self.gate is not None:
            while not self.gate.wait(0.01):
                if should_stop():
                    break
        while self.hang and not should_stop():
            time.sleep(0.01)
        for i, s in enumerate(samples):
            if i == 1 and any(f"@{tag}/" in s.id for tag in self.fail_on):
                raise RuntimeError("engine process died (SIGKILL)")
            s.append_model_turn([5] * 2, [-0.5] * 2, version, "abort" if should_stop() else "stop")

    def stage(self):  # pragma: no cover - weights travel through ScriptedSync
        raise NotImplementedError

    def load_weights(self, staged, version):
        with self.quiesced(version):
            self._set_version(version)
            self.loads.append(version)
            return [Receipt(worker=0, version=version, fingerprint="fp")]


class ScriptedSync(WeightSync):
    def __init__(self) -> None:
        self.calls = 0

    def publish(self, actor, engine, version):
        self.calls += 1
        return engine.load_weights(None, version), "fp"


def prompts(k: int, start: int = 0) -> list[Sample]:
    return [Sample(id=f"p{start + i}", prompt_ids=[1, 2, 3]) for i in range(k)]


def batch(gen: int, k: int = 2, n: int = 2) -> list[Sample]:
    return expand(prompts(k, start=10 * gen), n, tag=f"train-{gen}")


@pytest.fixture
def engine():
    eng = ScriptedEngine()
    yield eng
    if eng.gate is not None:
        eng.gate.set()
    eng.hang = False
    eng.close()


def group(gid: str, n: int = 2) -> list[Sample]:
    return [Sample(id=f"{gid}/{i}", prompt_ids=[1]) for i in range(n)]


# ---------------------------------------------------------------------------------------------- buffer


def test_buffer_evicts_stale_groups_first_then_drains_freshest():
    buf = VersionedBuffer()
    buf.observe(3)
    buf.put(group("p0@a"), weight_version=1, gen_id=0)  # staleness 2 at version 3
    buf.put(group("p1@b"), weight_version=2, gen_id=1)
    buf.put(group("p2@c"), weight_version=3, gen_id=2)
    buf.put(group("p3@c"), weight_version=2, gen_id=3)
    got = buf.drain_freshest(2, current_version=3, max_staleness=1)
    assert [g.group_id for g in got] == ["p2@c", "p1@b"]  # highest version; equal versions oldest launch first
    assert [g.group_id for g in buf.take_evicted()] == ["p0@a"]  # retrievable once, for metrics
    assert buf.take_evicted() == [] and len(buf) == 1


def test_buffer_short_drain_consumes_nothing():
    buf = VersionedBuffer()
    buf.observe(1)
    buf.put(group("p0@a"), 1, 0)
    assert buf.drain_freshest(2, current_version=1, max_staleness=0) == []
    assert len(buf) == 1
    assert [g.group_id for g in buf.drain_freshest(1, current_version=1, max_staleness=0)] == ["p0@a"]


def test_buffer_rejects_a_version_from_the_future_and_a_double_insert():
    buf = VersionedBuffer()
    buf.observe(2)
    with pytest.raises(StaleVersionError, match="from the future"):
        buf.put(group("p0@a"), weight_version=3, gen_id=0)
    buf.put(group("p0@a"), 2, 0)
    with pytest.raises(ValueError, match="double insert"):
        buf.put(group("p0@a"), 2, 0)
    with pytest.raises(ValueError, match="double insert"):  # all or none: p1@a is not inserted either
        buf.put_all([group("p1@a"), group("p0@a")], 2, 1)
    assert len(buf) == 1
    with pytest.raises(StaleVersionError, match="went back"):
        buf.drain_freshest(1, current_version=1, max_staleness=0)


# ------------------------------------------------------------------------------------------------ pool


def test_reap_is_complete_or_nothing_and_a_retry_never_inserts_twice(engine):
    engine.gate = threading.Event()
    pool, buf, calls = InflightPool(engine, "scripted"), VersionedBuffer(), []
    buf.observe(0)
    pool.launch(0, batch(0), SAMPLING, version=0)

    def handler(launch):
        calls.append(launch.gen_id)
        for s in launch.samples:  # the handler inserts as it goes, then fails once: a partial insert
            if s.id.endswith("/0"):
                buf.put([x for x in launch.samples if x.group_id == s.group_id], launch.version, launch.gen_id) \
                    if len(calls) > 1 else None
        if len(calls) == 1:
            raise ValueError("scorer hiccup")

    assert pool.reap(handler, timeout=0.05) == 0 and calls == []  # still generating: nothing handed out
    engine.gate.set()
    with pytest.raises(ValueError, match="hiccup"):
        pool.reap(handler, timeout=5)
    assert (pool.in_flight, pool.pending, engine.in_flight) == (0, 1, 0)  # back from the engine, kept
    assert pool.reap(handler) == 1 and calls == [0, 0] and len(pool) == 0
    assert len(buf) == 2  # two whole groups, each once
    assert pool.reap(handler) == 0 and calls == [0, 0]


def test_first_error_is_deferred_until_every_launch_is_reaped(engine):
    pool, handled = InflightPool(engine, "scripted"), []
    for g in range(3):
        pool.launch(g, batch(g), SAMPLING, version=0)

    def handler(launch):
        if launch.gen_id in (0, 1):
            raise RuntimeError(f"bad launch {launch.gen_id}")
        handled.append(launch.gen_id)

    with pytest.raises(RuntimeError, match="bad launch 0") as info:
        pool.drain_all(handler)
    assert handled == [2]  # reaped despite the earlier failures
    assert any("bad launch 1" in note for note in info.value.__notes__)
    assert engine.in_flight == 0 and pool.in_flight == 0 and pool.pending == 2


def test_keyboard_interrupt_passes_through_at_once(engine):
    pool, handled = InflightPool(engine, "scripted"), []
    pool.launch(0, batch(0), SAMPLING, version=0)
    pool.launch(1, batch(1), SAMPLING, version=0)

    def handler(launch):
        if launch.gen_id == 0:
            raise KeyboardInterrupt
        handled.append(launch.gen_id)

    with pytest.raises(KeyboardInterrupt):
        pool.reap(handler, timeout=5)
    assert handled == [] and len(pool) == 2  # not deferred: nothing after it ran, nothing lost
    pool.drain_all(lambda launch: None)


def test_drain_all_quiesces_the_engine(engine):
    engine.gate = threading.Event()
    pool = InflightPool(engine, "scripted")
    for g in range(2):
        pool.launch(g, batch(g), SAMPLING, version=0)
    threading.Timer(0.2, engine.gate.set).start()
    assert pool.drain_all(lambda launch: None, poll_s=0.05) == 2
    assert engine.in_flight == 0 and len(pool) == 0


def test_an_engine_killed_mid_rollout_fails_fast_naming_it_and_drops_the_launch_whole(engine):
    engine.fail_on = {"train-1"}
    pool, got = InflightPool(engine, "scripted"), []
    for g in range(3):
        pool.launch(g, batch(g), SAMPLING, version=0)
    t0 = time.monotonic()
    with pytest.raises(EngineFailedError, match="rollout engine 'scripted' failed launch 1") as info:
        pool.drain_all(lambda launch: got.append(launch.gen_id))
    assert time.monotonic() - t0 < 10
    assert "SIGKILL" in str(info.value) and "run.resume=true" in str(info.value)
    assert got == [0, 2] and len(pool) == 0 and engine.in_flight == 0  # launch 1 is nowhere, not half


def test_a_hung_engine_is_reported_within_the_stall_timeout(engine):
    engine.hang = True
    pool = InflightPool(engine, "scripted", stall_timeout_s=0.3)
    pool.launch(0, batch(0), SAMPLING, version=0)
    t0 = time.monotonic()
    with pytest.raises(EngineFailedError, match="has not finished launch 0"):
        pool.drain_all(lambda launch: None, poll_s=0.1)
    assert time.monotonic() - t0 < 5


# ------------------------------------------------------------------------------------------ controller


def controller(engine, *, staleness, interval, ledger_version=1):
    ledger = VersionLedger(version=ledger_version)
    engine._set_version(ledger_version)
    return BatchRolloutController(engine, ledger, engine_name="scripted", max_staleness=staleness,
                                  weight_sync_interval=interval, first_gen=0)


def build(gen):
    return batch(gen), SAMPLING


def test_launch_ceiling_keeps_staleness_zero_out_of_future_sync_windows(engine):
    ctrl = controller(engine, staleness=0, interval=1)
    assert ctrl.launch_ceiling() == 1
    assert ctrl.launch_until(10, max_inflight=5, build=build) == 1  # only the current step's batch
    ctrl.quiesce()
    sync = ScriptedSync()
    ctrl.sync_weights(sync, actor=None)
    assert ctrl.launch_ceiling() == 2 and ctrl.launch_until(10, 5, build) == 1
    for staleness, interval, want in [(1, 1, 2), (2, 1, 3), (0, 3, 3), (1, 2, 4)]:
        c = controller(ScriptedEngine(), staleness=staleness, interval=interval)
        assert c.launch_ceiling() == want, (staleness, interval)
        # every gen below the ceiling is consumed at most `staleness` versions after its launch
        assert all(c.version_at(g) - c.ledger.version <= staleness for g in range(want))
        assert c.version_at(want) - c.ledger.version == staleness + 1
    ctrl2 = controller(ScriptedEngine(), staleness=1, interval=1)
    assert ctrl2.launch_until(10, max_inflight=1, build=build) == 1  # max_inflight caps it
    ctrl2.quiesce()
    ctrl2.engine.close()


def test_launch_time_stamps_survive_a_later_sync(engine):
    ctrl = controller(engine, staleness=1, interval=1)
    ctrl.launch_until(2, max_inflight=2, build=build)
    ctrl.quiesce()  # both launches, stamped 1, are in the buffer
    ctrl.sync_weights(ScriptedSync(), actor=None)
    assert ctrl.ledger.version == 2
    first = next_drained(ctrl, 2, build)
    assert {g.version for g in first.groups} == {1} and first.staleness == [1, 1]
    assert all(v == 1 for g in first.groups for s in g.samples for v in s.versions)
    ctrl.launch_until(3, 2, build)  # gen 2, stamped 2
    got = next_drained(ctrl, 2, build)
    assert {g.gen_id for g in got.groups} == {1} and got.staleness == [1, 1]  # gen 1 is still waiting
    assert {g.gen_id for g in next_drained(ctrl, 2, build).groups} == {2}


def test_sync_is_refused_while_anything_is_in_flight_and_quiesce_comes_first(engine):
    engine.gate = threading.Event()
    ctrl = controller(engine, staleness=1, interval=1)
    sync = ScriptedSync()
    ctrl.launch_until(2, 2, build)
    with pytest.raises(SyncRefusedError, match="in flight on rollout engine 'scripted'"):
        ctrl.sync_weights(sync, actor=None)
    assert (ctrl.ledger.version, sync.calls, engine.loads) == (1, 0, [])  # nothing pushed, nothing moved
    with pytest.raises(SyncRefusedError, match="in flight"):  # the engine's own guard, bypassing the controller
        engine.load_weights(None, 2)
    engine.gate.set()
    ctrl.quiesce()
    assert ctrl.sync_weights(sync, actor=None)[0] == 2 and engine.loads == [2] and engine.weight_version == 2
    assert len(ctrl.ledger.history) == 1  # the ledger advanced exactly once, after the quiesce


def test_the_driver_refills_after_evictions(engine):
    ctrl = controller(engine, staleness=0, interval=1)
    ctrl.launch_until(1, 1, build)
    ctrl.quiesce()
    ctrl.sync_weights(ScriptedSync(), actor=None)  # gen 0's groups are now one version too old
    got = next_drained(ctrl, 2, build)
    assert [g.group_id for g in got.evicted] == ["p0@train-0", "p1@train-0"]
    assert got.staleness == [0, 0] and {g.gen_id for g in got.groups} == {1}


# --------------------------------------------------------------------- the real embedded engine


def test_controller_drives_the_embedded_engine_and_its_inprocess_sync():
    import torch

    from unirl.config import RunConfig
    from unirl.engine.torch_engine import TorchEngine
    from unirl.models.qwen3 import Qwen3Adapter
    from unirl.models.tokenizer import build_demo_tokenizer
    from unirl.sync.inprocess import InProcessSync

    tok = build_demo_tokenizer()
    config = RunConfig(model={"build": {"hidden_size": 64, "intermediate_size": 128}})
    eng = TorchEngine(config=config, adapter=Qwen3Adapter(), tokenizer=tok)
    model = Qwen3Adapter().build_model(config, tok)

    class Actor:
        def named_weights(self):
            return iter(model.state_dict().items())

    try:
        ledger = VersionLedger()
        ctrl = BatchRolloutController(eng, ledger, engine_name="torch", max_staleness=1, weight_sync_interval=1)
        sampling = SamplingParams(max_new_tokens=6)

        def build_real(gen):
            ps = [Sample(id=f"p{gen * 2 + i}", prompt_ids=tok.encode(f"Q: {i}+{gen}=? A:")) for i in range(2)]
            return expand(ps, 2, tag=f"train-{gen}", base_seed=0), sampling

        assert ctrl.launch_until(5, 2, build_real) == 2  # gens 0 and 1 at version 0
        assert eng.in_flight > 0
        with pytest.raises(SyncRefusedError):
            ctrl.sync_weights(InProcessSync(config=config), Actor())
        ctrl.quiesce()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
        version, receipts = ctrl.sync_weights(InProcessSync(config=config), Actor())
        assert version == 1 and receipts[0].version == 1 and eng.weight_version == 1
        got = next_drained(ctrl, 2, build_real)
        assert got.staleness == [1] * 2 and all(s.versions and set(s.versions) == {0} for s in got.samples)
    finally:
        eng.close()


def test_tokens_sampled_under_another_version_than_the_stamp_are_refused(engine):
    class Drifting(ScriptedEngine):
        def _run(self, samples, sampling, should_stop, version):
            super()._run(samples, sampling, should_stop, version + 1)  # as if weights changed mid-flight

    eng = Drifting()
    try:
        ctrl = controller(eng, staleness=0, interval=1)
        ctrl.launch_until(1, 1, build)
        with pytest.raises(SyncRefusedError, match="weights changed mid-flight"):
            ctrl.quiesce()
        assert len(ctrl.buffer) == 0 and ctrl.pool.pending == 1  # refused, kept out of the buffer
    finally:
        eng.close()
