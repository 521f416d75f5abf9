"""The RolloutEngine contract, on the embedded torch engine with a real tiny Qwen3.

Each test pins one seam of the contract (submit/poll/abort, the sync guard, continuation, request-keyed
seeds, output validation, staged weight validation) and fails when that seam breaks. The bad weight
payloads come from ``weight_payloads.py`` so every engine is held to the same list and messages.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

from unirl.config import RunConfig
from unirl.contracts import EngineCapabilities, SamplingParams, fingerprint
from unirl.engine.torch_engine import TorchEngine
from unirl.kernel.errors import SampleError, SyncRefusedError, WeightSyncError
from unirl.models.qwen3 import Qwen3Adapter
from unirl.models.tokenizer import build_demo_tokenizer
from unirl.samples import NO_VERSION, OBSERVATION_LOGPROB, Sample, Segment, stable_seed
from unirl.testing import build_engine, default_runtime

_spec = importlib.util.spec_from_file_location("unirl_weight_payloads", Path(__file__).with_name("weight_payloads.py"))
weight_payloads = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(weight_payloads)

PROMPTS = ["Q: 1+2=? A:", "Q: 12+7=? A:", "hi", "Q: 19*19=? A: the answer is"]
LABELS = ["unknown name", "wrong shape", "wrong dtype", "nan", "missing tensor", "duplicate name", "untied lm_head"]


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


def make_engine(tok, **options) -> TorchEngine:
    return build_engine(RunConfig(rollout={"options": options}), adapter=Qwen3Adapter(), tokenizer=tok)


@pytest.fixture(scope="module")
def engine(tok):
    eng = make_engine(tok)
    yield eng
    eng.close()


@pytest.fixture
def fresh(tok):
    """Engines built by the test, closed after it (a failed test leaves no generation running)."""
    made: list[TorchEngine] = []

    def build(**options) -> TorchEngine:
        made.append(make_engine(tok, **options))
        return made[-1]

    yield build
    for eng in made:
        eng.close()


def seeded(tok, prefix="s", prompts=PROMPTS, seed0=100) -> list[Sample]:
    return [Sample(id=f"{prefix}{i}@t/0", prompt_ids=tok.encode(p), seed=seed0 + i) for i, p in enumerate(prompts)]


def wait_until(cond, timeout=30.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.001)


def state_fingerprint(eng: TorchEngine) -> str:
    return fingerprint(eng.model.state_dict().items())


def perturbed(eng: TorchEngine, seed=0, scale=0.05) -> list[tuple[str, torch.Tensor]]:
    """A complete valid payload: the engine's own weights (spec names, serving dtype), perturbed."""
    g = torch.Generator().manual_seed(seed)
    state = eng.model.state_dict()
    return [(n, state[n] + scale * torch.randn(state[n].shape, generator=g)) for n in eng.spec.shapes]


def tokens(samples):
    return [(s.id, s.response_ids, s.rollout_logprobs, s.finish_reason) for s in samples]


def test_declares_name_and_capabilities():
    assert TorchEngine.name == "torch"
    assert TorchEngine.capabilities(RunConfig(), TorchEngine.Config()) == EngineCapabilities(
        weight_syncs=("inprocess",), logprobs="raw", continuation=True, async_submit=True, requests_across_sync="queued",
        routing_record=True)


def test_runtime_installs_engine_parity_before_the_model_is_built(tok):
    calls: list[str] = []

    class Recorder:
        parity = None  # no provider enabled: the engine keeps its fast path

        def install_engine(self, engine: str) -> None:
            calls.append(f"install:{engine}")

    class Adapter(Qwen3Adapter):
        def build_model(self, config, tokenizer=None):
            calls.append("build")
            return super().build_model(config, tokenizer)

    TorchEngine(config=RunConfig(), adapter=Adapter(), tokenizer=tok, runtime=Recorder())
    assert calls == ["install:torch", "build"]


# ----------------------------------------------------------------------------- submit / poll / abort


def test_abort_mid_generation_keeps_partial_turns_and_leaks_nothing(tok, fresh):
    eng = fresh()
    sp = SamplingParams(max_new_tokens=4000, temperature=0.0)  # greedy: long, no eos in reach
    samples = seeded(tok, "a", PROMPTS[:3])
    handle = eng.submit(samples, sp)
    assert eng.in_flight == 3
    wait_until(lambda: all(s.requests[-1].first_token_ms for s in samples))
    out = eng.abort(handle)
    assert sorted(s.id for s in out) == sorted(s.id for s in samples)
    for s in out:
        assert (s.finish_reason, s.status) == ("abort", "truncated")
        assert 0 < len(s.response_ids) < 4000
        assert len(s.loss_mask) == len(s.rollout_logprobs) == len(s.versions) == len(s.response_ids)
        assert s.segments == [Segment("model", 0, 0, len(s.response_ids))]
        s.validate(source="torch")
        rec = s.requests[-1]
        assert rec.finish_reason == "abort" and rec.new_tokens == len(s.response_ids) and rec.engine == "torch"
        assert rec.submitted_ms <= rec.first_token_ms <= rec.finished_ms
    assert eng.in_flight == 0
    assert eng.poll(handle) == [] and eng.poll() == []
    # what an aborted row kept is exactly what an unaborted run generates up to that length
    for s in out:
        ref = eng.generate([Sample(id=s.id, prompt_ids=s.prompt_ids, seed=s.seed)],
                           SamplingParams(max_new_tokens=len(s.response_ids), temperature=0.0))[0]
        assert ref.response_ids == s.response_ids
        torch.testing.assert_close(torch.tensor(ref.rollout_logprobs), torch.tensor(s.rollout_logprobs),
                                   atol=1e-6, rtol=0)
    # the engine still serves
    again = eng.generate(seeded(tok, "b", PROMPTS[:2]), SamplingParams(max_new_tokens=6))
    assert all(s.status in ("ok", "truncated") and s.response_ids for s in again)
    assert eng.in_flight == 0


def test_abort_of_a_queued_submission_and_pause(tok, fresh):
    eng = fresh()
    long = seeded(tok, "l", PROMPTS[:1])
    h_long = eng.submit(long, SamplingParams(max_new_tokens=4000, temperature=0.0))
    wait_until(lambda: long[0].requests[-1].first_token_ms)
    queued = seeded(tok, "q", PROMPTS[1:2])
    h_queued = eng.submit(queued, SamplingParams(max_new_tokens=4))
    (q,) = eng.abort(h_queued)  # never started: an empty aborted turn
    assert q.response_ids == [] and q.finish_reason == "abort" and q.status == "truncated"
    q.validate(source="torch")
    assert eng.in_flight == 1
    eng.abort(h_long)
    assert eng.in_flight == 0
    # pause: nothing new starts until resume
    eng.pause()
    p = seeded(tok, "p", PROMPTS[:1])
    h = eng.submit(p, SamplingParams(max_new_tokens=4))
    time.sleep(0.2)
    assert eng.poll(h) == [] and not p[0].requests[-1].first_token_ms and eng.in_flight == 1
    eng.resume()
    wait_until(lambda: p[0].requests[-1].finished_ms)
    assert [s.id for s in eng.poll(h, timeout=5)] == [p[0].id]
    assert len(p[0].response_ids) == 4 and eng.in_flight == 0


def test_generate_runs_on_the_callers_thread_and_the_worker_exits_when_idle(tok, fresh):
    """An idle engine thread keeps its OpenMP team alive, and libgomp then throttles every team in the
    process (the module doc of ``unirl.engine.queued``). So a blocking ``generate`` on an idle engine runs
    on the caller's thread, and the worker started by ``submit`` is gone once the queue is empty."""
    import threading

    eng = fresh()
    eng.merges_jobs = False  # an engine that runs one job at a time (a merging one: test_merged_batching.py)
    ran_on: list[int] = []
    run = eng._run

    def recording_run(*args, **kwargs):
        ran_on.append(threading.get_ident())
        return run(*args, **kwargs)

    eng._run = recording_run
    sp = SamplingParams(max_new_tokens=5)
    ref = tokens(eng.generate(seeded(tok), sp))
    assert ran_on == [threading.get_ident()] and eng._thread is None and eng.in_flight == 0
    assert not [t for t in threading.enumerate() if t.name.endswith("-rollout")]
    samples = seeded(tok)
    got = eng.poll(eng.submit(samples, sp), timeout=30)
    assert tokens(sorted(got, key=lambda s: s.id)) == sorted(ref)  # same bookkeeping, same tokens either way
    assert ran_on[1] != threading.get_ident()
    wait_until(lambda: eng._thread is None)  # the worker exits on an empty queue...
    assert tokens(eng.generate(seeded(tok), sp)) == ref  # ...and the next generate is inline again
    assert ran_on[2] == threading.get_ident()
    assert tokens(sorted(eng.poll(eng.submit(seeded(tok), sp), timeout=30), key=lambda s: s.id)) == sorted(ref)


def test_generate_queues_behind_running_work_and_an_inline_job_obeys_abort_and_the_sync_guard(tok, fresh):
    import threading

    eng = fresh()
    long = seeded(tok, "l", PROMPTS[:1])
    h_long = eng.submit(long, SamplingParams(max_new_tokens=4000, temperature=0.0))
    wait_until(lambda: long[0].requests[-1].first_token_ms)
    done: list[Sample] = []
    behind = threading.Thread(target=lambda: done.extend(eng.generate(seeded(tok, "g", PROMPTS[1:2]),
                                                                      SamplingParams(max_new_tokens=3))))
    behind.start()
    time.sleep(0.2)
    assert not done and eng.in_flight == 2  # queued behind the running job, not run beside it
    eng.abort(h_long)
    behind.join(timeout=30)
    assert [len(s.response_ids) for s in done] == [3] and eng.in_flight == 0
    # an inline generate counts as in flight: a sync is refused, and abort() from another thread stops it
    inline = seeded(tok, "i", PROMPTS[:2])
    errors: list[BaseException] = []

    def sync_then_abort() -> None:
        wait_until(lambda: all(s.requests and s.requests[-1].first_token_ms for s in inline))
        try:
            eng.load_weights(perturbed(eng), version=1)
        except SyncRefusedError as exc:
            errors.append(exc)
        eng.abort()

    side = threading.Thread(target=sync_then_abort)
    side.start()
    out = eng.generate(inline, SamplingParams(max_new_tokens=4000, temperature=0.0))
    side.join(timeout=30)
    assert len(errors) == 1 and "2 request(s) in flight" in str(errors[0])
    assert [s.finish_reason for s in out] == ["abort", "abort"] and all(0 < len(s.response_ids) < 4000 for s in out)
    assert eng.in_flight == 0 and eng.weight_version == 0


# ----------------------------------------------------------------------------- sync guard


def test_sync_refused_while_in_flight_and_old_weights_keep_serving(tok, fresh):
    eng = fresh()
    sp = SamplingParams(max_new_tokens=12)
    ref = tokens(eng.generate(seeded(tok), sp))
    before = state_fingerprint(eng)
    samples = seeded(tok)
    handle = eng.submit(samples, sp)  # not polled
    with pytest.raises(SyncRefusedError, match=r"4 request\(s\) in flight.*still serves version 0"):
        eng.load_weights(perturbed(eng), version=1)
    staged = eng.stage()
    for name, t in perturbed(eng, seed=1):
        staged.add(name, t)
    with pytest.raises(SyncRefusedError):
        eng.load_weights(staged, version=1)
    # finished but not reaped is still in flight: the controller has not taken its work back
    wait_until(lambda: all(s.requests[-1].finished_ms for s in samples))
    assert eng.in_flight == 4
    with pytest.raises(SyncRefusedError):
        eng.load_weights(perturbed(eng), version=1)
    assert eng.weight_version == 0 and state_fingerprint(eng) == before
    got = eng.poll(handle, timeout=5)
    assert tokens(sorted(got, key=lambda s: s.id)) == sorted(ref)
    assert all(s.versions == [0] * len(s.response_ids) for s in got)
    assert tokens(eng.generate(seeded(tok), sp)) == ref  # same seed, same old weights, same tokens
    eng.load_weights(staged, version=1)  # reaped: accepted
    assert eng.weight_version == 1 and state_fingerprint(eng) != before
    assert tokens(eng.generate(seeded(tok), sp)) != ref


# ----------------------------------------------------------------------------- continuation


def test_continuation_matches_actor_replay(tok):
    from unirl.actor.torch_actor import TorchActor

    config, adapter = RunConfig(), Qwen3Adapter()
    actor = TorchActor(config=config, runtime=default_runtime(config), adapter=adapter, tokenizer=tok)
    eng = TorchEngine(config=config, runtime=default_runtime(config), adapter=adapter, tokenizer=tok, model=actor.model)
    samples = seeded(tok, "c")
    sp = SamplingParams(max_new_tokens=10)
    eng.generate(samples, sp)
    n0 = [len(s.response_ids) for s in samples]
    obs = tok.encode("\n<obs>42</obs>\n")
    for s in samples:
        s.append_observation(obs, text="\n<obs>42</obs>\n")
    eng.generate(samples, sp)
    for s, a in zip(samples, n0, strict=True):
        b = a + len(obs)
        assert s.segments == [Segment("model", 0, 0, a), Segment("observation", 0, a, b),
                              Segment("model", 1, b, len(s.response_ids))]
        assert len(s.response_ids) > b
        assert s.response_ids[a:b] == obs
        assert s.loss_mask[a:b] == [0] * len(obs)
        assert s.rollout_logprobs[a:b] == [OBSERVATION_LOGPROB] * len(obs)
        assert s.versions[a:b] == [NO_VERSION] * len(obs)
        assert s.loss_mask[:a] == [1] * a and s.loss_mask[b:] == [1] * (len(s.response_ids) - b)
        assert [r.turn for r in s.requests] == [0, 1]
        assert s.requests[1].prompt_tokens == len(s.prompt_ids) + b
        s.validate(source="torch")
    replay = actor.logprobs(samples)
    for s, lp in zip(samples, replay, strict=True):
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        got = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        torch.testing.assert_close(got[mask], lp.float()[mask], atol=1e-5, rtol=0)


def test_response_budget_caps_continuations(engine, tok):
    s = seeded(tok, "r", PROMPTS[:1])[0]
    sp = SamplingParams(max_new_tokens=8, max_response_tokens=14, temperature=0.0)
    engine.generate([s], sp)
    assert len(s.response_ids) == 8
    s.append_observation(tok.encode("ok"))
    assert sp.new_token_limit(s) == 4
    engine.generate([s], sp)  # capped by the response budget, not max_new_tokens
    assert len(s.response_ids) == 14 and s.segments[-1] == Segment("model", 1, 10, 14)
    assert (s.finish_reason, s.requests[-1].new_tokens) == ("length", 4)
    assert sp.new_token_limit(s) == 0
    engine.generate([s], sp)  # budget spent: an empty turn, "length"
    assert s.segments[-1] == Segment("model", 2, 14, 14) and s.finish_reason == "length"
    assert len(s.requests) == 3 and s.requests[-1].new_tokens == 0
    s.validate(source="torch")


# ----------------------------------------------------------------------------- seeds


def request(tok) -> Sample:
    rid = "p3@train-0/1"
    return Sample(id=rid, prompt_ids=tok.encode("Q: 4+4=? A:"), seed=stable_seed(7, rid))


def test_request_keyed_seeds(engine, tok):
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95)
    alone = engine.generate([request(tok)], sp)[0]
    others = [Sample(id=f"o{i}", prompt_ids=tok.encode(p), seed=None if i % 2 else 50 + i)
              for i, p in enumerate(PROMPTS * 2)]
    assert len(others) == 8
    inside = next(s for s in engine.generate(others[:5] + [request(tok)] + others[5:], sp) if s.id == alone.id)
    assert inside.response_ids == alone.response_ids
    torch.testing.assert_close(torch.tensor(inside.rollout_logprobs), torch.tensor(alone.rollout_logprobs),
                               atol=1e-5, rtol=0)
    for k in range(3):  # other steps: the engine's own generator advances, other requests come and go
        engine.generate([Sample(id=f"x{k}{i}", prompt_ids=tok.encode(p)) for i, p in enumerate(PROMPTS)], sp)
    later = engine.generate([Sample(id="u", prompt_ids=tok.encode("zz")), request(tok)], sp)[1]
    assert later.response_ids == alone.response_ids
    # the next turn is keyed on the request too: same continuation alone and in a batch
    a, b = alone, inside
    for s in (a, b):
        s.append_observation(tok.encode(" obs "))
    engine.generate([a], sp)
    engine.generate(others[:3] + [b], sp)
    assert a.response_ids == b.response_ids and a.turns == b.turns == 2
    # and a different request draws differently
    other = request(tok)
    other.seed = stable_seed(7, "p3@train-1/1")
    assert engine.generate([other], sp)[0].response_ids != alone.response_ids[: len(other.response_ids)]


# ----------------------------------------------------------------------------- stop strings


def test_stop_strings_end_a_turn_and_keep_the_stop_text(engine, tok):
    greedy = engine.generate(seeded(tok, "g"), SamplingParams(max_new_tokens=30, temperature=0.0,
                                                               stop_token_ids=()))
    g = greedy[0]
    # a two-character printable stop string taken from the middle of the greedy text
    j = next(j for j in range(4, len(g.response_ids) - 1)
             if all(tok.decode([t]).isascii() and tok.decode([t]).isprintable() for t in g.response_ids[j:j + 2]))
    stop = tok.decode(g.response_ids[j:j + 2])
    sp = SamplingParams(max_new_tokens=30, temperature=0.0, stop=(stop,))
    out = engine.generate(seeded(tok, "g"), sp)
    for ref, s in zip(greedy, out, strict=True):
        ends = [k for k in range(1, len(ref.response_ids) + 1)
                if stop in tok.decode(ref.response_ids[:k], skip_special_tokens=True)]
        if ends:
            k = ends[0]
            assert s.response_ids == ref.response_ids[:k] and (s.finish_reason, s.status) == ("stop", "ok")
            assert stop in s.response_text  # the stop string is kept in the text
            assert s.response_text == tok.decode(s.response_ids, skip_special_tokens=True)
        else:
            assert s.response_ids == ref.response_ids and s.finish_reason == ref.finish_reason
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs),
                                   torch.tensor(ref.rollout_logprobs[: len(s.response_ids)]), atol=1e-5, rtol=0)
    assert out[0].finish_reason == "stop" and len(out[0].response_ids) <= j + 2


# ----------------------------------------------------------------------------- output validation


def test_malformed_output_is_named(engine, tok):
    s = engine.generate(seeded(tok, "m", PROMPTS[:1]), SamplingParams(max_new_tokens=6, stop_token_ids=()))[0]
    s.validate(source="torch")
    dropped = s.copy()
    dropped.rollout_logprobs.pop()
    with pytest.raises(SampleError, match=r"sample m0@t/0 from torch is malformed: rollout_logprobs has"):
        dropped.validate(source="torch")
    gap = s.copy()
    gap.segments = [Segment("model", 0, 1, len(s.response_ids))]
    with pytest.raises(SampleError, match=r"sample m0@t/0 from torch .*does not start where"):
        gap.validate(source="torch")
    positive = s.copy()
    positive.rollout_logprobs[0] = 0.5
    with pytest.raises(SampleError, match=r"m0@t/0 from torch .*not a log-probability"):
        positive.validate(source="torch")
    mask = s.copy()
    mask.loss_mask[0] = 0
    with pytest.raises(SampleError, match=r"m0@t/0 from torch .*must have loss_mask 1"):
        mask.validate(source="torch")


# ----------------------------------------------------------------------------- staged weight validation


def test_bad_payload_list_covers_every_case(engine):
    assert [label for label, _, _ in weight_payloads.bad_payloads(perturbed(engine))] == LABELS


@pytest.mark.parametrize("label", LABELS)
def test_bad_payload_rejected_before_any_weight_changes(engine, tok, label):
    case = {c[0]: c for c in weight_payloads.bad_payloads(perturbed(engine, seed=3))}[label]
    _, payload, match = case
    version, before = engine.weight_version, state_fingerprint(engine)
    with pytest.raises(WeightSyncError, match=match):
        engine.load_weights(payload, version=version + 1)
    # the same payload through stage() (how a sync sends it) fails the same way
    with pytest.raises(WeightSyncError, match=match):
        staged = engine.stage()
        for name, t in payload:
            staged.add(name, t)
        engine.load_weights(staged, version=version + 1)
    assert engine.weight_version == version and state_fingerprint(engine) == before
    assert engine.in_flight == 0
    engine.generate(seeded(tok, "w", PROMPTS[:1]), SamplingParams(max_new_tokens=2))  # still serving


def test_good_payload_loads_and_receipt_fingerprints_what_is_served(tok, fresh):
    eng = fresh()
    good = perturbed(eng, seed=4)
    for _, payload, match in weight_payloads.bad_payloads(good):
        with pytest.raises(WeightSyncError, match=match):
            eng.load_weights(payload, version=1)
    (receipt,) = eng.load_weights(good, version=5)
    assert (receipt.worker, receipt.version, receipt.num_tensors) == (0, 5, len(good))
    assert receipt.fingerprint == fingerprint(good)
    assert eng.weight_version == 5
    state = eng.model.state_dict()
    assert all(torch.equal(state[n], t) for n, t in good)
    assert eng.model.lm_head.weight.data_ptr() == eng.model.model.embed_tokens.weight.data_ptr()
    staged = eng.stage()
    for n, t in good:
        staged.add(n, t)
    eng.load_weights(staged, version=6)
    with pytest.raises(WeightSyncError, match="already loaded"):
        staged.add(*good[0])
