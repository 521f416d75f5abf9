"""The embedded TorchEngine against a teacher-forced replay of real (tiny) transformers Qwen3 weights."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from unirl.config import RunConfig
from unirl.contracts import SamplingParams, fingerprint
from unirl.engine.sampler import gumbel_noise
from unirl.engine.torch_engine import TorchEngine
from unirl.kernel.errors import OptionsError, SampleError, SyncRefusedError, WeightSyncError
from unirl.models.qwen3 import Qwen3Adapter
from unirl.models.tokenizer import build_demo_tokenizer
from unirl.samples import Sample, expand
from unirl.testing import build_engine, default_runtime

PROMPTS = ["Q: 1+2=? A:", "Q: 12+7=? A:", "Q: 3-15=? A:", "hi", "Q: 19*19=? A: the answer is", "7"]


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


def make_engine(tok, **options) -> TorchEngine:
    return build_engine(RunConfig(rollout={"options": options}), adapter=Qwen3Adapter(), tokenizer=tok)


@pytest.fixture(scope="module", params=[True, False], ids=["fast", "hf"])
def engine(request, tok):
    return make_engine(tok, fast_path=request.param)


def samples_for(tok, prompts=PROMPTS, seed0: int | None = 100) -> list[Sample]:
    return [
        Sample(id=f"p{i}", prompt_ids=tok.encode(p), seed=None if seed0 is None else seed0 + i)
        for i, p in enumerate(prompts)
    ]


def replay(model, s: Sample) -> torch.Tensor:
    """Teacher-forced fp32 log-probs of s's response: one plain forward of prompt + response."""
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(s.prompt_ids) - 1 : -1], dim=-1)
    return lp.gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]


def replay_logits(model, s: Sample) -> torch.Tensor:
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        return model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1].float()


def assert_matches_replay(model, samples, atol=1e-5):
    for s in samples:
        s.validate()
        assert s.response_ids, s.id
        got = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        torch.testing.assert_close(got, replay(model, s), atol=atol, rtol=0)


def outputs(samples):
    return [(s.id, s.response_ids, s.rollout_logprobs, s.finish_reason) for s in samples]


# ----------------------------------------------------------------------------- numerics


def test_engine_path_selection(tok):
    assert make_engine(tok).fast
    assert not make_engine(tok, fast_path=False).fast


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_new_tokens=24),
        SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.9, top_k=50),
        SamplingParams(max_new_tokens=24, temperature=0.0),
    ],
    ids=["t1", "filtered", "greedy"],
)
def test_logprobs_equal_teacher_forced_replay(engine, tok, sampling):
    samples = engine.generate(samples_for(tok), sampling)
    assert len({len(s.prompt_ids) for s in samples}) > 3  # left padding is exercised
    assert_matches_replay(engine.model, samples)


def test_logprobs_match_replay_when_rows_stop_at_different_times(engine, tok):
    # many stop tokens: rows finish early at different steps and the batch is compacted
    stops = tuple(tok.encode("0123456789abcdefghij"))
    samples = engine.generate(samples_for(tok, PROMPTS * 3, seed0=5),
                              SamplingParams(max_new_tokens=40, stop_token_ids=stops))
    lengths = {len(s.response_ids) for s in samples}
    assert len(lengths) > 2
    assert any(s.finish_reason == "stop" for s in samples)
    assert_matches_replay(engine.model, samples)


def test_bf16_engine_generates(tok):
    eng = make_engine(tok, dtype="bfloat16")
    assert eng.model.model.embed_tokens.weight.dtype == torch.bfloat16
    samples = eng.generate(samples_for(tok), SamplingParams(max_new_tokens=8))
    for s in samples:
        assert len(s.response_ids) == 8 and all(isinstance(x, float) for x in s.rollout_logprobs)
    assert_matches_replay(eng.model, samples, atol=1e-2)


@pytest.mark.parametrize("block", [128, 3])
def test_bf16_decode_over_the_whole_cache_computes_the_slices_attention(tok, monkeypatch, block):
    """In bf16 a decode step attends over the whole zero-filled cache with the later columns masked
    (``FastDecoder.whole_cache``: the CPU's bf16 batched matmul copies a slice). The oracle is the slice
    itself, the fp32 path's attention: the same tokens fed to both give the same logits up to bf16's
    rounding, rows of different lengths (left padding) included. A later column that were attended (a
    zero key at score 0) would move the logits past that. With 3-column blocks the cache grows a block
    at a time during the decode (``CACHE_BLOCK``: 128 in use, where these decodes fit in one block), so
    the copies of the written columns into the grown cache are checked too."""
    from unirl.engine import fast_decoder, rows
    from unirl.engine.fast_decoder import FastDecoder

    monkeypatch.setattr(fast_decoder, "CACHE_BLOCK", block)

    eng = make_engine(tok, dtype="bfloat16")
    assert eng.decoder.whole_cache and not make_engine(tok).decoder.whole_cache  # on in bf16 on the CPU only
    # a model on another device keeps the slice (no GPU here: the meta device stands in for one)
    assert not FastDecoder(copy.deepcopy(eng.decoder.model).to("meta"), torch.bfloat16).whole_cache
    contexts = [tok.encode(p) for p in PROMPTS[:3]]
    assert len({len(c) for c in contexts}) > 1
    new = 16
    ids, pos, valid, plen = rows.left_pad(contexts, new, eng.pad_id, torch.device("cpu"))
    feed = torch.randint(3, 60, (len(contexts), new), generator=torch.Generator().manual_seed(0))

    widths = []

    def logits(whole: bool) -> torch.Tensor:
        eng.decoder.whole_cache = whole
        state = eng.decoder.prefill(ids, pos, valid, new)
        out = [state["logits"]]
        for t in range(new):
            out.append(eng.decoder.step(state, feed[:, t : t + 1], (plen + t)[:, None], ids.shape[1] + t))
            widths.append(state["kv"][0][0].shape[2]) if whole else None
        return torch.stack(out).float()

    with torch.no_grad():
        whole, sliced = logits(True), logits(False)
    assert whole.abs().max() > 0.5
    # equal bits on the AMD EPYC this was written on; three later columns attended moved a logit by 0.17
    torch.testing.assert_close(whole, sliced, atol=0.02, rtol=0)
    P = ids.shape[1]  # each step's width: the keys so far in whole blocks, at most the decode's allocation
    assert widths == [min(P + new, -(-(P + t + 1) // block) * block) for t in range(new)]
    if block == 3:
        assert len(set(widths)) > 3  # the cache grew several times during the decode


# ----------------------------------------------------------------------------- sampling


def test_same_seeds_same_outputs(engine, tok):
    sp = SamplingParams(max_new_tokens=20)
    a = engine.generate(samples_for(tok), sp)
    b = engine.generate(samples_for(tok), sp)
    assert outputs(a) == outputs(b)
    c = engine.generate(samples_for(tok, seed0=999), sp)
    assert [s.response_ids for s in a] != [s.response_ids for s in c]


def test_seeded_sample_does_not_depend_on_its_batch(engine, tok):
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.95)
    alone = engine.generate([Sample(id="x", prompt_ids=tok.encode("Q: 4+4=? A:"), seed=42)], sp)[0]
    others = [Sample(id=f"o{i}", prompt_ids=tok.encode(p), seed=7 + i) for i, p in enumerate(PROMPTS + ["zz"])]
    batch = others[:3] + [Sample(id="x", prompt_ids=tok.encode("Q: 4+4=? A:"), seed=42)] + others[3:]
    assert len(batch) == 8
    inside = engine.generate(batch, sp)[3]
    assert inside.id == "x"
    assert inside.response_ids == alone.response_ids
    torch.testing.assert_close(torch.tensor(inside.rollout_logprobs), torch.tensor(alone.rollout_logprobs),
                               atol=1e-5, rtol=0)


def test_unseeded_samples_reproducible_per_engine_seed(tok):
    sp = SamplingParams(max_new_tokens=16)
    a = make_engine(tok, seed=3).generate(samples_for(tok, seed0=None), sp)
    b = make_engine(tok, seed=3).generate(samples_for(tok, seed0=None), sp)
    c = make_engine(tok, seed=4).generate(samples_for(tok, seed0=None), sp)
    assert outputs(a) == outputs(b)
    assert [s.response_ids for s in a] != [s.response_ids for s in c]


def test_greedy_is_argmax_of_replay_and_top_k_1_is_greedy(engine, tok):
    greedy = engine.generate(samples_for(tok), SamplingParams(max_new_tokens=16, temperature=0.0))
    for s in greedy:
        assert replay_logits(engine.model, s).argmax(-1).tolist() == s.response_ids
    top1 = engine.generate(samples_for(tok, seed0=77), SamplingParams(max_new_tokens=16, temperature=1.3, top_k=1))
    assert [s.response_ids for s in top1] == [s.response_ids for s in greedy]


def test_sampling_follows_the_distribution():
    # the counter-based Gumbel noise samples softmax(logits): check frequencies on a fixed distribution
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    seeds = torch.arange(4000, dtype=torch.int64) * 7919 + 11
    picks = (logits + gumbel_noise(seeds, 0, 4)).argmax(-1)
    freq = torch.bincount(picks, minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), atol=0.03, rtol=0)
    # different steps of one row are different draws
    assert not torch.equal(gumbel_noise(seeds[:4], 0, 8), gumbel_noise(seeds[:4], 1, 8))


def test_top_p_and_top_k_restrict_the_support(engine, tok):
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=3)
    for s in engine.generate(samples_for(tok), sp):
        logits = replay_logits(engine.model, s)
        top3 = logits.topk(3, dim=-1).indices
        assert all(t in row for t, row in zip(s.response_ids, top3.tolist(), strict=True))
    sp = SamplingParams(max_new_tokens=12, temperature=0.5, top_p=0.2)
    for s in engine.generate(samples_for(tok), sp):
        probs = torch.softmax(replay_logits(engine.model, s) / 0.5, dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) <= 0.2  # the smallest prefix reaching top_p
        for t, row_order, row_keep in zip(s.response_ids, order, keep, strict=True):
            assert t in row_order[row_keep].tolist()


# ----------------------------------------------------------------------------- stopping


def test_stop_tokens_and_length(engine, tok):
    greedy = engine.generate(samples_for(tok)[:1], SamplingParams(max_new_tokens=12, temperature=0.0))[0]
    assert greedy.finish_reason == "length" and greedy.status == "truncated"
    assert len(greedy.response_ids) == 12
    assert greedy.response_text == tok.decode(greedy.response_ids)
    stop_tok = greedy.response_ids[4]
    first = greedy.response_ids.index(stop_tok)
    s = engine.generate(samples_for(tok)[:1], SamplingParams(max_new_tokens=12, temperature=0.0,
                                                             stop_token_ids=(stop_tok,)))[0]
    assert s.response_ids == greedy.response_ids[: first + 1]  # the stop token is kept (it is learnt)
    assert (s.finish_reason, s.status) == ("stop", "ok")
    assert s.response_text == tok.decode(greedy.response_ids[:first])  # text without it
    assert s.rollout_logprobs == greedy.rollout_logprobs[: first + 1]


def test_eos_stops(engine, tok):
    # every token is a stop token: one token each, finish_reason stop
    all_ids = tuple(range(len(tok)))
    for s in engine.generate(samples_for(tok), SamplingParams(max_new_tokens=5, stop_token_ids=all_ids)):
        assert len(s.response_ids) == 1 and s.finish_reason == "stop" and s.status == "ok"
    assert tok.eos_token_id in engine.eos_ids


def test_expand_siblings_keep_ids_and_order(engine, tok):
    roots = [Sample(id=f"p{i}", prompt_ids=tok.encode(p)) for i, p in enumerate(PROMPTS[:3])]
    slots = expand(roots, 4, base_seed=1, tag="train-0")
    out = engine.generate(slots, SamplingParams(max_new_tokens=8))
    assert out is slots
    assert [s.id for s in out] == [f"p{i}@train-0/{j}" for i in range(3) for j in range(4)]
    assert all(s.group_id == f"p{i}@train-0" for i in range(3) for s in out[4 * i : 4 * i + 4])
    assert all(s.versions == [engine.weight_version] * len(s.response_ids) for s in out)
    assert all(s.loss_mask == [1] * len(s.response_ids) for s in out)
    assert len({tuple(s.response_ids) for s in out[:4]}) > 1  # siblings draw different completions


def test_batch_size_option_chunks_without_changing_results(tok):
    sp = SamplingParams(max_new_tokens=10)
    big = make_engine(tok).generate(samples_for(tok), sp)
    small = make_engine(tok, batch_size=2).generate(samples_for(tok), sp)
    assert [s.response_ids for s in small] == [s.response_ids for s in big]


def test_empty_prompt_rejected(engine):
    with pytest.raises(SampleError, match="empty prompt"):
        engine.generate([Sample(id="e", prompt_ids=[])], SamplingParams())


def test_unknown_option_is_a_config_error(tok):
    """Found by the kernel, once, before the engine is built (no engine parses its own options)."""
    with pytest.raises(OptionsError, match="rollout.options.batch_sise") as info:
        make_engine(tok, batch_sise=3)
    assert [(v.source, v.field) for v in info.value.violations] == [("unirl-core", "rollout.options.batch_sise")]


def test_engine_owns_its_weights(tok):
    config = RunConfig()
    model = Qwen3Adapter().build_model(config, tok)
    eng = TorchEngine(config=config, runtime=default_runtime(config), adapter=Qwen3Adapter(), tokenizer=tok, model=model)
    before = model.model.embed_tokens.weight.clone()
    eng.load_weights([(n, torch.zeros_like(p)) for n, p in eng.model.named_parameters()], version=1)
    assert torch.equal(eng.model.model.embed_tokens.weight, torch.zeros_like(before))
    assert torch.equal(model.model.embed_tokens.weight, before)


# ----------------------------------------------------------------------------- weight sync


def perturbed(model, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + scale * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "hf"])
def test_load_weights_changes_generation_and_matches_replay(tok, fast_path):
    eng = make_engine(tok, fast_path=fast_path)
    sp = SamplingParams(max_new_tokens=16)
    before = eng.generate(samples_for(tok), sp)
    assert all(s.versions == [0] * len(s.response_ids) for s in before)
    new = perturbed(eng.model)
    receipts = eng.load_weights(iter(new), version=3)
    assert len(receipts) == 1
    r = receipts[0]
    assert (r.worker, r.version, r.num_tensors) == (0, 3, len(new))
    assert r.fingerprint == fingerprint(new)
    assert eng.weight_version == 3
    # tied embeddings stay tied
    assert eng.model.lm_head.weight.data_ptr() == eng.model.model.embed_tokens.weight.data_ptr()
    after = eng.generate(samples_for(tok), sp)
    assert [s.response_ids for s in after] != [s.response_ids for s in before]
    assert all(s.versions == [3] * len(s.response_ids) for s in after)
    assert_matches_replay(eng.model, after)
    # the replay model built fresh from the sent tensors agrees too (the engine serves exactly them)
    fresh = Qwen3Adapter().build_model(RunConfig(), tok).eval()
    fresh.load_state_dict(dict(new), strict=False)
    assert_matches_replay(fresh, after)


def test_loading_embeddings_updates_tied_lm_head(tok):
    eng = make_engine(tok)
    w = eng.model.model.embed_tokens.weight.detach() * 1.5
    rest = [(n, p.detach()) for n, p in eng.model.named_parameters() if n != "model.embed_tokens.weight"]
    eng.load_weights([("model.embed_tokens.weight", w), *rest], version=1)
    assert torch.equal(eng.model.lm_head.weight, w)
    # both names, equal values: fine; different values: refused
    eng.load_weights([("model.embed_tokens.weight", w), ("lm_head.weight", w), *rest], version=2)
    with pytest.raises(WeightSyncError, match="ties lm_head.weight"):
        eng.load_weights([("model.embed_tokens.weight", w), ("lm_head.weight", w + 1), *rest], version=3)
    assert eng.weight_version == 2
    assert torch.equal(eng.model.lm_head.weight, w)


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda t: [(n, x[:-1] if "embed" in n else x) for n, x in t], "model.embed_tokens.weight.*shape"),
        (lambda t: [(n, x.clone().fill_(float("nan")) if n.endswith("layers.1.mlp.up_proj.weight") else x)
                    for n, x in t], "layers.1.mlp.up_proj.weight.*NaN"),
        (lambda t: [*t, ("model.layers.9.mlp.up_proj.weight", t[0][1])], "model.layers.9.mlp.up_proj.weight"),
        (lambda t: [*t, t[0]], "twice"),
        (lambda t: [(n, x.to(torch.int64) if n == "model.norm.weight" else x) for n, x in t],
         "model.norm.weight.*dtype"),
    ],
    ids=["shape", "nan", "unknown", "duplicate", "dtype"],
)
def test_bad_weights_are_refused_and_old_weights_keep_serving(tok, corrupt, match):
    eng = make_engine(tok)
    sp = SamplingParams(max_new_tokens=12)
    eng.load_weights(perturbed(eng.model, seed=1), version=1)
    before = outputs(eng.generate(samples_for(tok), sp))
    state = {k: v.clone() for k, v in eng.model.state_dict().items()}
    # the bad tensor comes last in the stream for most cases: everything before it must stay untouched
    with pytest.raises(WeightSyncError, match=match):
        eng.load_weights(corrupt(perturbed(eng.model, seed=2)), version=2)
    assert eng.weight_version == 1
    assert all(torch.equal(state[k], v) for k, v in eng.model.state_dict().items())
    after = eng.generate(samples_for(tok), sp)
    assert outputs(after) == before
    assert all(s.versions == [1] * len(s.response_ids) for s in after)


def test_load_weights_refused_while_generating(tok):
    eng = make_engine(tok)
    # a long greedy generation is running (its first token is out) when the sync arrives
    s = Sample(id="long", prompt_ids=tok.encode("Q: 1+2=? A:"), seed=1)
    handle = eng.submit([s], SamplingParams(max_new_tokens=4000, temperature=0.0))
    deadline = time.time() + 30
    while not s.requests[-1].first_token_ms and time.time() < deadline:
        time.sleep(0.001)
    assert s.requests[-1].first_token_ms, "generation never started"
    with pytest.raises(SyncRefusedError, match="in flight"):
        eng.load_weights(perturbed(eng.model), version=9)
    assert eng.weight_version == 0
    assert [x.id for x in eng.abort(handle)] == ["long"]
    assert s.finish_reason == "abort" and eng.in_flight == 0
    eng.load_weights(perturbed(eng.model), version=9)  # idle again: accepted
    assert eng.weight_version == 9


def _splitmix64(z: int) -> int:
    """splitmix64's finaliser on Python ints: the oracle for the engine's vectorised, in-place hash."""
    z &= (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return z ^ (z >> 31)


def test_gumbel_noise_is_the_documented_hash():
    # noise(seed, step, token) = -log(-log(u)), u from the top 24 bits of
    # mix(mix(mix(seed) + (step+1) gamma) + (token+1) gamma), as the module doc says
    gamma = 0x9E3779B97F4A7C15
    seeds = torch.tensor([0, 1, 12345, -7, (1 << 62) + 3], dtype=torch.int64)
    for step in (0, 5):
        got = gumbel_noise(seeds, step, 16)
        for r, seed in enumerate(seeds.tolist()):
            key = _splitmix64(_splitmix64(seed) + (step + 1) * gamma)
            for tok_id in (0, 7, 15):
                u = ((_splitmix64(key + (tok_id + 1) * gamma) >> 40) + 0.5) / (1 << 24)
                want = -torch.log(-torch.log(torch.tensor(u, dtype=torch.float32)))
                assert torch.equal(got[r, tok_id], want), (seed, step, tok_id)


def test_fast_path_norm_and_rope_are_the_modules_bits():
    # the fast decode path restates transformers' RMSNorm (fused) and RoPE (q and k at once): the bits
    # must be the modules' own, or the engine's numerics would drift from the model's
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    from unirl.engine.fast_decoder import _rms_norm, _rope_qk

    before = torch.get_num_threads()
    for dtype in (torch.float32, torch.bfloat16):
        for width in (32, 128, 256, 1000, 4096):
            for rows in (1, 64, 333):
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    g = torch.Generator().manual_seed(width + rows)
                    norm = Qwen3RMSNorm(width, eps=1e-6).to(dtype)
                    norm.weight.data = torch.randn(width, generator=g).to(dtype)
                    x = (3 * torch.randn(rows, width, generator=g)).to(dtype)
                    try:
                        assert torch.equal(_rms_norm(norm, x), norm(x)), (dtype, width, rows, threads)
                    finally:
                        torch.set_num_threads(before)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 8, 3, 32, generator=g), torch.randn(5, 4, 3, 32, generator=g)
    cos, sin = torch.randn(5, 3, 32, generator=g), torch.randn(5, 3, 32, generator=g)
    for got, want in zip(_rope_qk(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin), strict=True):
        assert torch.equal(got, want)
    # q_norm and k_norm as one call over q's and k's heads side by side (a fused qkv GEMM's output)
    from unirl.engine.fast_decoder import _qk_norm

    for dtype in (torch.float32, torch.bfloat16):
        for rows, n_q, n_kv in ((1, 8, 4), (64, 8, 4), (7, 16, 2), (300, 4, 4)):
            q_norm, k_norm = Qwen3RMSNorm(32, eps=1e-6).to(dtype), Qwen3RMSNorm(32, eps=1e-6).to(dtype)
            q_norm.weight.data = torch.randn(32, generator=g).to(dtype)
            k_norm.weight.data = torch.randn(32, generator=g).to(dtype)
            heads = (3 * torch.randn(rows, 1, n_q + 2 * n_kv, 32, generator=g)).to(dtype)  # q | k | v
            got = _qk_norm(q_norm, k_norm, heads[:, :, : n_q + n_kv], n_q)
            assert torch.equal(got[:, :, :n_q], q_norm(heads[:, :, :n_q])), (dtype, rows)
            assert torch.equal(got[:, :, n_q:], k_norm(heads[:, :, n_q : n_q + n_kv])), (dtype, rows)


def test_a_group_prefills_once_and_its_rows_decode_as_if_prefilled_alone(tok, monkeypatch):
    """Equal contexts (the n samples of a GRPO group) share one prefill (``rows.shared_prefill``); every row
    then decodes what it would have decoded from its own prefill, and matches the teacher-forced replay."""
    from unirl.engine import rows

    share = rows.shared_prefill([[1, 2], [3], [1, 2], [3], [4]])
    first, fan = share
    assert first.tolist() == [0, 1, 4] and fan.tolist() == [0, 1, 0, 1, 2]
    assert rows.prefix_served([[1, 2], [3], [1, 2], [3], [4]], share) == [0, 0, 2, 1, 0]
    assert rows.shared_prefill([[1], [2]]) is None and rows.prefix_served([[1], [2]], None) == [0, 0]
    eng = make_engine(tok)
    group = [Sample(id=f"g{i}", prompt_ids=tok.encode(PROMPTS[i % 3]), seed=500 + i) for i in range(9)]
    sp = SamplingParams(max_new_tokens=12, temperature=1.0)
    calls = []
    prefill = eng.decoder.prefill
    monkeypatch.setattr(eng.decoder, "prefill", lambda ids, *a: calls.append(ids.shape[0]) or prefill(ids, *a))
    shared = eng.generate([s.copy() for s in group], sp)
    assert calls == [3]  # three distinct prompts, one prefill row each
    monkeypatch.setattr(rows, "shared_prefill", lambda contexts: None)
    alone = eng.generate([s.copy() for s in group], sp)
    assert calls == [3, 9]
    assert [s.response_ids for s in shared] == [s.response_ids for s in alone]
    for a, b in zip(shared, alone, strict=True):
        torch.testing.assert_close(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs),
                                   atol=1e-6, rtol=0)
    assert_matches_replay(eng.model, shared)


def test_fast_path_fused_projections_alias_the_parameters_and_follow_a_weight_load(tok):
    eng = make_engine(tok)
    assert eng.decoder.fused and all(qkv is not None and glu is not None for qkv, glu in eng.decoder.fused)
    layer = eng.model.model.layers[0]
    qkv, glu = eng.decoder.fused[0]
    a, mlp = layer.self_attn, layer.mlp
    assert torch.equal(qkv, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
    assert a.v_proj.weight.data_ptr() == qkv[-a.v_proj.weight.shape[0]:].data_ptr()  # views, not copies
    g = torch.Generator().manual_seed(3)
    state = eng.model.state_dict()
    eng.load_weights([(n, state[n] + 0.01 * torch.randn(state[n].shape, generator=g)) for n in eng.spec.shapes],
                     version=1)
    assert torch.equal(qkv, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
    assert torch.equal(glu, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    out = eng.generate(samples_for(tok), SamplingParams(max_new_tokens=8))
    assert_matches_replay(eng.model, out)  # the fused GEMMs serve the loaded weights
