"""Stream mode's engine contract (``requests_across_sync: queued``, docs/async.md) on the ``sglang`` engine
against the stand-in server: a sync pauses the engine, the job running on the server is restarted
(``on_sync: abort``: ``/abort_request``, its partial turn dropped) or ends under its weights, the load goes
through with a job still queued, and after the resume both run under the new weights: every token carries
the new version and its log-prob is the new model's (a transformers replay of the perturbed weights)."""

from __future__ import annotations

import time

import pytest
from sglang_testing import make_engine, replay

from unirl.api import Sample, SamplingParams, SyncRefusedError, fingerprint


@pytest.fixture(scope="module")
def engine(standin, tiny_model_dir, tmp_path_factory):
    eng = make_engine(tiny_model_dir, tmp_path_factory.mktemp("run"), [standin.url])
    yield eng
    eng.close()


def _job(tag: str, k: int = 2) -> list[Sample]:
    return [Sample(id=f"{tag}{i}", prompt_ids=[3 + i, 7, 11, 5], seed=500 + i) for i in range(k)]


def _perturbed(model_dir, seed: int):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model, [(n, t.detach().clone()) for n, t in model.state_dict().items() if n != "lm_head.weight"]


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_paused_sglang_engine_restarts_the_running_job_and_loads_under_the_queued_one(engine, standin,
                                                                                       tiny_model_dir):
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0)
    running, queued = _job("r"), _job("q")
    base = engine.weight_version
    standin.pause(True)  # the server holds the first job's requests: it is running, the second waits behind it
    try:
        h1 = engine.submit(running, sampling)
        h2 = engine.submit(queued, sampling)
        _wait(lambda: standin.active == 2, "the first job reached the server")
        model, named = _perturbed(tiny_model_dir, seed=11)
        staged = engine.stage()
        staged.fingerprint = fingerprint(staged.tap(iter(named)))
        with pytest.raises(SyncRefusedError):
            engine.load_weights(staged, base + 1)  # not paused: in-flight work refuses a load
        engine.pause()
        assert sorted(engine.restart_running()) == ["r0", "r1"]  # rollout.stream.on_sync: abort
        _wait(lambda: sum(p == "/abort_request" for p, _ in list(standin.log)) >= 2, "aborts sent to the server")
    finally:
        standin.pause(False)
    try:
        assert engine.wait_running(30) and engine.in_flight == 4  # nothing runs; both jobs queued
        assert all(not s.response_ids for s in running)  # the aborted partial turn is gone
        staged = engine.stage()
        staged.fingerprint = fingerprint(staged.tap(iter(named)))
        engine.load_weights(staged, base + 1)
    finally:
        engine.resume()
    done = engine.poll(h1, timeout=60) + engine.poll(h2, timeout=60)
    assert sorted(s.id for s in done) == ["q0", "q1", "r0", "r1"] and engine.in_flight == 0
    for s in done:  # every token sampled by the new weights, once (one request record, no old prefix)
        assert s.response_ids and s.versions == [base + 1] * len(s.response_ids) and len(s.requests) == 1
        assert max(abs(a - b) for a, b in zip(s.rollout_logprobs, replay(model, s), strict=True)) < 1e-5
