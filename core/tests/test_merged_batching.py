"""Continuous batching in the embedded engine (unirl.engine.merged): queued jobs join a running batch.

Oracles: the same engine with ``merges_jobs = False`` (one job at a time, the path every other test of
the engine checks against a teacher-forced replay), and the request records' clocks."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from unirl.config import RunConfig
from unirl.contracts import SamplingParams
from unirl.engine.torch_engine import TorchEngine
from unirl.models.qwen3 import Qwen3Adapter
from unirl.models.tokenizer import build_demo_tokenizer
from unirl.samples import Sample
from unirl.testing import build_engine

PROMPTS = ["Q: 1+2=? A:", "Q: 12+7=? A:", "hi", "Q: 19*19=? A: the answer is", "7"]
SP = SamplingParams(max_new_tokens=40, temperature=1.0)


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


@pytest.fixture
def fresh(tok):
    made: list[TorchEngine] = []

    def build(**options) -> TorchEngine:
        made.append(build_engine(RunConfig(rollout={"options": options}), adapter=Qwen3Adapter(), tokenizer=tok))
        return made[-1]

    yield build
    for eng in made:
        eng.close()


def batch(tok, tag: str, seed0: int, suffix: str = "") -> list[Sample]:
    return [Sample(id=f"{tag}{i}@t/0", prompt_ids=tok.encode(p + suffix), seed=seed0 + i) for i, p in enumerate(PROMPTS)]


def alone(eng: TorchEngine, samples: list[Sample], sp: SamplingParams = SP) -> list[Sample]:
    eng.merges_jobs = False
    try:
        return eng.generate(samples, sp)
    finally:
        eng.merges_jobs = True


def out(samples):
    return [(s.response_ids, s.rollout_logprobs, s.finish_reason) for s in samples]


def wait_all(eng, handles, n):
    got: list[Sample] = []
    deadline = time.time() + 120
    while len(got) < n:
        assert time.time() < deadline, "timed out"
        for h in handles:
            got += eng.poll(h, timeout=0.05)
    return got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_job_that_meets_no_other_gets_the_bits_it_gets_alone(fresh, tok, dtype):
    eng = fresh(dtype=dtype)
    assert eng.merges_jobs
    merged = eng.generate(batch(tok, "a", 100), SP)
    assert out(merged) == out(alone(eng, batch(tok, "a", 100)))
    assert {s.finish_reason for s in merged} <= {"stop", "length"}


def test_a_queued_job_joins_the_running_batch_and_keeps_its_tokens(fresh, tok):
    """Job 2 is submitted once job 1 decodes; it starts before job 1 ends (one at a time, it could not),
    draws the tokens it draws alone, and its log-probs differ from alone only by the merged batch's GEMM
    shapes (fp32 rounding: 1e-5)."""
    eng = fresh()
    long = SamplingParams(max_new_tokens=48, temperature=1.0, ignore_eos=True)
    one, two = batch(tok, "a", 100), batch(tok, "b", 500, " ok")
    h1 = eng.submit(one, long)
    deadline = time.time() + 60
    while not one[0].requests[-1].first_token_ms:
        assert time.time() < deadline
        time.sleep(0.001)
    h2 = eng.submit(two, long)
    wait_all(eng, [h1, h2], 10)
    assert max(s.requests[-1].first_token_ms for s in two) < min(s.requests[-1].finished_ms for s in one)
    ref1, ref2 = alone(eng, batch(tok, "a", 100), long), alone(eng, batch(tok, "b", 500, " ok"), long)
    for got, ref in zip(one + two, ref1 + ref2, strict=True):
        assert got.response_ids == ref.response_ids and got.finish_reason == ref.finish_reason
        torch.testing.assert_close(torch.tensor(got.rollout_logprobs), torch.tensor(ref.rollout_logprobs),
                                   atol=1e-5, rtol=0)
        assert got.versions == ref.versions and got.requests[-1].finished_ms >= got.requests[-1].first_token_ms


def test_abort_ends_only_its_jobs_rows_and_a_paused_engine_admits_nothing(fresh, tok):
    eng = fresh()
    long = SamplingParams(max_new_tokens=150, temperature=1.0, ignore_eos=True)
    one, two = batch(tok, "a", 100), batch(tok, "b", 500)
    h1 = eng.submit(one, long)
    h2 = eng.submit(two, long)
    deadline = time.time() + 60
    while not two[0].requests[-1].first_token_ms:
        assert time.time() < deadline
        time.sleep(0.001)
    assert {s.finish_reason for s in eng.abort(h2)} == {"abort"}
    eng.pause()
    three = batch(tok, "c", 900)
    h3 = eng.submit(three, long)
    assert eng.wait_running(60)  # job 1 ran to its end; job 3 waits in the queue, not in the batch
    assert [len(s.response_ids) for s in eng.poll(h1, timeout=1)] == [150] * 5
    assert not three[0].response_ids and eng.in_flight == 5
    eng.resume()
    assert [s.finish_reason for s in wait_all(eng, [h3], 5)] == ["length"] * 5


def test_an_error_in_the_merged_batch_fails_every_job_in_it_and_the_engine_serves_on(fresh, tok):
    eng = fresh()
    real, calls = eng.decoder.step, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 30:
            raise RuntimeError("lost the device")
        return real(*a, **k)

    eng.decoder.step = failing
    long = SamplingParams(max_new_tokens=60, temperature=1.0, ignore_eos=True)
    h1, h2 = eng.submit(batch(tok, "a", 100), long), eng.submit(batch(tok, "b", 500), long)
    for h in (h1, h2):
        with pytest.raises(RuntimeError, match="lost the device"):
            deadline = time.time() + 60
            while not eng.poll(h, timeout=0.05):
                assert time.time() < deadline
    assert eng.in_flight == 0
    assert len(eng.generate(batch(tok, "c", 900), SP)) == 5


def test_generate_on_a_merging_engine_runs_on_the_worker_which_exits_when_idle(fresh, tok):
    eng = fresh()
    eng.generate(batch(tok, "a", 100), SP)
    deadline = time.time() + 30
    while eng._thread is not None:
        assert time.time() < deadline
        time.sleep(0.001)
    assert not [t for t in threading.enumerate() if t.name.endswith("-rollout")]


def test_a_subclass_replacing_run_must_say_whether_it_merges():
    with pytest.raises(TypeError, match="merges_jobs = False"):
        type("Hooked", (TorchEngine,), {"_run": lambda self, *a: None})


@pytest.mark.parametrize("merging", [True, False], ids=["merged", "alone"])
def test_restart_running_drops_the_partial_turn_and_reruns_under_the_new_weights(fresh, tok, merging):
    """``rollout.stream.on_sync: abort`` on the engine: pause, restart the running job, load, resume. The job
    comes back whole, every token of the new version, and the very tokens the new weights give it afresh."""
    eng = fresh()
    eng.merges_jobs = merging
    long = SamplingParams(max_new_tokens=60, temperature=1.0, ignore_eos=True)
    job = batch(tok, "a", 100)
    h = eng.submit(job, long)
    deadline = time.time() + 60
    while not job[0].requests[-1].first_token_ms:
        assert time.time() < deadline
        time.sleep(0.001)
    eng.pause()
    assert sorted(eng.restart_running()) == sorted(s.id for s in job)
    assert eng.wait_running(60) and eng.in_flight == 5
    assert all(not s.response_ids and not s.requests[-1].first_token_ms for s in job)  # the partial turn is gone
    g = torch.Generator().manual_seed(0)
    eng.load_weights(iter([(n, p.detach() + 0.05 * torch.randn(p.shape, generator=g))
                           for n, p in eng.model.named_parameters()]), version=1)
    eng.resume()
    got = wait_all(eng, [h], 5)
    assert all(s.versions == [1] * 60 and s.finish_reason == "length" and len(s.requests) == 1 for s in got)
    assert out(job) == out(alone(eng, batch(tok, "a", 100), long))
