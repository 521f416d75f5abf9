"""rollout.mode: stream (docs/async.md) on the embedded engine: a run trains whole groups, each once, within
the staleness bound; staleness 0 is on-policy; the pool's invariants (complete or nothing, never inserted
twice, the first error after every launch is accounted for, a stall fails fast and names the engine);
a checkpoint stores the drained buffer and a resume trains no group twice; preflight of the stream keys."""

from __future__ import annotations

import importlib.util
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from unirl.config import RunConfig, load_config
from unirl.contracts import EngineCapabilities, RolloutController, VersionLedger
from unirl.engine.torch_engine import TorchEngine
from unirl.kernel import load_kernel
from unirl.kernel.errors import WorkerLostError
from unirl.kernel.hookspecs import hookimpl
from unirl.models.qwen3 import Qwen3Adapter
from unirl.models.tokenizer import build_demo_tokenizer
from unirl.preflight import preflight
from unirl.rollout.stream import EngineStalledError, StreamingController
from unirl.samples import Sample
from unirl.testing import build_engine
from unirl.trainer.loop import train

_spec = importlib.util.spec_from_file_location("unirl_async_trainer_tests", Path(__file__).with_name("test_async_trainer.py"))
_async = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_async)
PARITY, ParityReward, RatioSpy, small_config = _async.PARITY, _async.ParityReward, _async.RatioSpy, _async.small_config

ROOT = Path(__file__).resolve().parents[2]
STREAM_KEYS = {"stream/occupancy", "stream/evicted_groups", "stream/evicted_total", "stream/sync_pause_s",
               "stream/buffer_depth", "stream/staleness_0", "stream/staleness_1", "staleness_max", "version"}


class TrainedGroups:
    """Every sample the trainer was handed, per step (``unirl_on_rollout``, phase train)."""

    def __init__(self) -> None:
        self.steps: dict[int, list[Sample]] = {}

    @hookimpl
    def unirl_on_rollout(self, phase, step, samples):
        if phase == "train":
            self.steps.setdefault(step, []).extend(samples)


def group_of(s: Sample) -> str:
    return s.id.rsplit("/", 1)[0]  # "<prompt>@stream-<k>/<i>": the launch's group


def run_stream(tmp_path, name, *extra, kernel=None):
    spy, kernel = TrainedGroups(), kernel or load_kernel()
    kernel.register(spy, entry_point="trained-groups", dist="test-trained-groups", version="0")
    result = train(small_config(tmp_path, name, "rollout.mode=stream", "sft.steps=0", *extra), kernel)
    return result, spy


def test_stream_trains_whole_groups_once_within_the_bound(tmp_path):
    result, spy = run_stream(tmp_path, "s1", "trainer.steps=4", "rollout.max_staleness=1")
    assert sorted(spy.steps) == [0, 1, 2, 3]
    seen: Counter[str] = Counter()
    for _step, samples in spy.steps.items():
        sizes = Counter(group_of(s) for s in samples)
        assert len(sizes) == 4 and set(sizes.values()) == {4}  # prompts_per_step whole groups of rollout.n
        seen.update(sizes.keys())
        for s in samples:
            assert 0 <= s.meta["staleness"] <= 1  # the bound, from the oldest model token
            assert min(v for v, m in zip(s.versions, s.loss_mask, strict=True) if m) == s.meta["min_version"]
    assert max(seen.values()) == 1  # no group trained twice
    rows = [h for h in result.history if h.get("step", 0) >= 1]
    for h in rows:
        assert STREAM_KEYS <= h.keys()
        assert 0.0 < h["stream/occupancy"] <= 1.0 + 1e-9
        assert h["stream/staleness_0"] + h["stream/staleness_1"] == 4
    assert rows[-1]["version"] == rows[0]["version"] + 3  # a sync every step


@pytest.mark.slow
def test_stream_staleness_zero_is_on_policy(tmp_path, monkeypatch):
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    monkeypatch.delenv("UNIRL_PARITY_DIR", raising=False)
    spy, kernel = RatioSpy(), load_kernel()
    kernel.register(spy, entry_point="ratio-spy", dist="test-ratio-spy", version="0")
    kernel.register(ParityReward(), entry_point="parity-reward", dist="test-parity-reward", version="0")
    result, groups = run_stream(tmp_path, "s0", "rollout.max_staleness=0", "trainer.steps=3", "reward.name=token-parity",
                                "actor.lr=3e-3", *PARITY, kernel=kernel)
    assert sorted(spy.dev) == [0, 1, 2]
    assert max(spy.dev.values()) < 1e-6, spy.dev  # every batch's first-update PPO ratio is 1
    assert all(s.meta["staleness"] == 0 for ss in groups.steps.values() for s in ss)


def test_a_resumed_stream_run_trains_no_group_twice(tmp_path):
    args = ["trainer.steps=4", "trainer.save_every=2"]
    first, spy1 = run_stream(tmp_path, "r", "trainer.steps=2", *args[1:])
    saved = tmp_path / "r" / "checkpoints"
    assert (saved / "latest").read_text().strip() == "step_000002"
    resumed, spy2 = run_stream(tmp_path, "r", "run.resume=true", *args)
    assert sorted(spy2.steps) == [2, 3]
    before = {group_of(s) for ss in spy1.steps.values() for s in ss}
    after = [group_of(s) for ss in spy2.steps.values() for s in ss]
    assert not before & set(after)  # the checkpoint stored the drained buffer minus what was trained
    import torch

    stored = torch.load(saved / "step_000002" / "extra.pt", weights_only=False)["trainer"]["controller"]["stream"]
    kept = {group_of(x[0]) for _, x, _ in stored["buffer"]}
    assert kept and not kept & before  # drained: whole groups, none of them trained before the save
    launch = [int(g.rsplit("stream-", 1)[1]) for g in after]
    # restored: the evictions counted so far go on, and the stored groups are in the buffer again (freshest
    # first may prefer new groups to them; then they wait, or are evicted, and are never trained twice)
    first_row = next(h for h in resumed.history if h.get("step") == 3)
    assert first_row["stream/evicted_total"] >= stored["evicted_total"]
    trained_stored = [g for g in after if g in kept]
    assert len(trained_stored) == 4 * len(set(trained_stored))  # whole, once
    assert all(g in kept or k >= stored["next"] for g, k in zip(after, launch, strict=True))  # new ids are new
    assert max(Counter(after).values()) == 4  # whole groups, once each


# ---------------------------------------------------------------------- the pool's invariants
class Scripted(RolloutController):
    """A controller whose one-group collects do what a test says per launch tag: return a group after a
    delay, raise, or block until released (a hung engine)."""

    concurrent_collects = True

    def __init__(self, script) -> None:
        self.script, self.release = script, threading.Event()
        self.calls: list[str] = []

    def collect(self, draw, *, groups, n, sampling, launch_tag):
        self.calls.append(launch_tag)
        return self.script(self, launch_tag)

    def metrics(self):
        return {}

    def warm_start_samples(self, prompts):
        return []

    def close(self):
        self.release.set()


def group(tag: str, version: int = 0, n: int = 2) -> list[Sample]:
    out = []
    for i in range(n):
        s = Sample(id=f"p@{tag}/{i}", prompt_ids=[1, 2])
        s.append_model_turn([3, 4], [-0.1, -0.2], version, "stop")
        out.append(s)
    return out


@pytest.fixture(scope="module")
def engine():
    eng = build_engine(RunConfig(), adapter=Qwen3Adapter(), tokenizer=build_demo_tokenizer())
    yield eng
    eng.close()


def pool(engine, ctl, **kw):
    args = {"slots": 3, "max_staleness": 1, "stall_timeout_s": 30.0, "engine_name": "torch", "buffer_cap": 8, **kw}
    return StreamingController(ctl, engine, VersionLedger(), collect_group=lambda tag: ctl.collect(
        None, groups=1, n=2, sampling=None, launch_tag=tag), **args)


def test_the_first_error_is_raised_after_every_launch_is_accounted_for(engine):
    def script(ctl, tag):
        if tag == "stream-1":
            raise ConnectionError("worker died")
        time.sleep(0.3)  # the others are still running when launch 1 fails
        return group(tag)

    p = pool(engine, Scripted(script))
    with pytest.raises(ConnectionError, match="worker died"):
        p.take(5)
    assert p.in_flight == 0  # nothing left running behind the error
    ids = {g.launch for g in p._buffer}
    assert ids == {0, 2}  # the others are whole in the buffer; the failed launch inserted nothing
    assert all(len(g.samples) == 2 for g in p._buffer)
    p.close()


def test_a_launch_enters_the_buffer_once_and_stale_groups_are_evicted(engine):
    ctl = Scripted(lambda ctl, tag: group(tag, version=0))
    p = pool(engine, ctl, slots=1, buffer_cap=1)
    taken = p.take(1)
    assert [len(g.samples) for g in taken] == [2]
    with pytest.raises(RuntimeError, match="entered the buffer twice"):
        p._insert(taken[0])  # a retry of the same launch never inserts twice
    p.quiesce()
    p.ledger.version = 2  # two versions on: a version-0 group is past max_staleness 1
    depth = p.buffer_depth
    with p._cv:
        p._evict()
    assert p.buffer_depth == 0 and p.evicted_total == depth >= 1
    p.close()


def test_a_hung_engine_fails_fast_naming_it_and_its_launches(engine):
    def script(ctl, tag):
        ctl.release.wait(60)  # hung: no group ever finishes
        return group(tag)

    ctl = Scripted(script)
    p = pool(engine, ctl, stall_timeout_s=1.0, slots=2)
    t0 = time.monotonic()
    with pytest.raises(EngineStalledError, match=r"rollout engine 'torch' made no progress.*stream-0, stream-1") as e:
        p.take(1)
    assert time.monotonic() - t0 < 5  # within the stall timeout, not the hang
    assert isinstance(e.value, WorkerLostError)  # restartable (run.max_restarts)
    p.close()
    ctl.release.set()


def test_preflight_refuses_stream_where_the_engine_or_controller_cannot(tmp_path):
    class NoKeep(TorchEngine):
        name = "torch-nokeep"

        @classmethod
        def capabilities(cls, config, options):
            return EngineCapabilities(weight_syncs=("inprocess",), logprobs=config.rollout.logprobs)

    class Plugin:
        @hookimpl
        def unirl_rollout_engines(self):
            return {"torch-nokeep": NoKeep}

    kernel = load_kernel()
    kernel.register(Plugin(), entry_point="nokeep", dist="test-nokeep", version="0")
    base = ROOT / "recipes" / "arith-tiny.yaml"
    ok = preflight(load_config(base, ["rollout.mode=stream"]), kernel)
    assert [v.field for v in ok] == []
    bad = preflight(load_config(base, ["rollout.mode=stream", "rollout.engine=torch-nokeep"]), kernel)
    assert [v.field for v in bad] == ["rollout.mode"] and "requests_across_sync" in bad[0].message
    with pytest.raises(Exception, match="stall_timeout_s"):
        load_config(base, ["rollout.stall_timeout_s=.inf"])
    inert = preflight(load_config(base, ["rollout.stream.inflight=8", "rollout.stall_timeout_s=5"]), kernel)
    assert sorted(v.field for v in inert) == ["rollout.stream"]  # ignored outside stream (the stall timeout is not)


def test_a_paused_engine_loads_with_queued_requests_which_then_run_under_the_new_weights(engine):
    """Stream mode's sync on the embedded engine (requests_across_sync: queued): pause, wait until nothing
    runs (the running request ends under version 0), load version 1 with a request still queued, resume:
    the queued request's tokens carry version 1. Unpaused, the same load is refused."""
    from unirl.contracts import SamplingParams
    from unirl.kernel.errors import SyncRefusedError

    tok = build_demo_tokenizer()
    first = [Sample(id="a@t/0", prompt_ids=tok.encode("Q: 1+2=? A:"), seed=1)]
    second = [Sample(id="b@t/0", prompt_ids=tok.encode("Q: 3+4=? A:"), seed=2)]
    state = engine.model.state_dict()
    payload = [(n, state[n].clone()) for n in engine.spec.shapes]
    base = engine.weight_version
    h1 = engine.submit(first, SamplingParams(max_new_tokens=256, ignore_eos=True))
    h2 = engine.submit(second, SamplingParams(max_new_tokens=8, ignore_eos=True))
    with pytest.raises(SyncRefusedError):
        engine.load_weights(payload, base + 1)  # not paused: in-flight work refuses a load
    deadline = time.monotonic() + 30
    while not first[0].requests[-1].first_token_ms:  # a is running (b queued behind it)
        assert time.monotonic() < deadline
        time.sleep(0.001)
    engine.pause()
    assert engine.wait_running(30)
    engine.load_weights(payload, base + 1)  # b is still queued
    engine.resume()
    done = {s.id: s for s in engine.poll(h1, timeout=30) + engine.poll(h2, timeout=30)}
    assert set(done["a@t/0"].versions) == {base} and set(done["b@t/0"].versions) == {base + 1}
    assert engine.in_flight == 0


def test_evictions_free_the_buffer_and_launching_resumes(engine):
    """max_staleness 0 and a full buffer: a version bump evicts every buffered group, and the next take
    launches again instead of waiting on an empty pool (a hang before the fix)."""
    ledger = VersionLedger()
    ctl = Scripted(lambda ctl, tag: group(tag, version=ledger.version))
    p = StreamingController(ctl, engine, ledger, collect_group=lambda tag: ctl.collect(
        None, groups=1, n=2, sampling=None, launch_tag=tag), slots=2, max_staleness=0, stall_timeout_s=10.0,
        engine_name="torch", buffer_cap=1)
    p.take(1)
    deadline = time.monotonic() + 20
    while p.in_flight or p.buffer_depth < 1:  # launching has paused: the buffer is full (version-0 groups)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ledger.version = 1
    got: list = []
    t = threading.Thread(target=lambda: got.extend(p.take(1)), daemon=True)
    t.start()
    t.join(20)
    assert len(got) == 1 and got[0].min_version == 1 and p.evicted_total >= 1
    p.close()


def test_a_launch_of_several_groups_enters_the_buffer_group_by_group(engine):
    def two_groups(ctl, tag):  # groups_per_launch 2: two prompts, rollout.n 2 each
        return [s for q in ("p", "q") for s in group(tag) if s.id.replace("p@", f"{q}@")
                and not setattr(s, "id", s.id.replace("p@", f"{q}@"))]

    ctl = Scripted(two_groups)
    p = pool(engine, ctl, slots=1, buffer_cap=2)
    taken = p.take(3)
    assert [len(g.samples) for g in taken] == [2, 2, 2]
    assert len({(g.launch, g.samples[0].group_id) for g in taken}) == 3  # three distinct whole groups
    assert all(len({s.group_id for s in g.samples}) == 1 for g in taken)
    p.close()
