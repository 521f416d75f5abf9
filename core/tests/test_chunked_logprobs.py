"""Log-probs without the whole logits (issue 65 item 6): :mod:`unirl.actor.chunked_logprobs`.

The oracle is the direct path as it was before chunking (:func:`direct_logprobs`, kept here verbatim):
the whole ``[N, V]`` fp32 logits, their log-softmax, the gather. At Qwen3's 151,936-token vocabulary the
chunked forward gives the same log-probs and entropy bit for bit (raw and processed), the same gradients
bit for bit for every parameter but the (tied) output projection's weight, whose token sum the chunks
re-associate (equal to 1e-6 relative), and a replay and a training step whose peak of torch-allocated
bytes is at least 4x lower. Peak memory is read from torch's profiler: every allocation and free of the
call, in order, with its size (the same law on any machine, unlike RSS).
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from unirl.actor import chunked_logprobs
from unirl.actor.chunked_logprobs import ROW_ALIGN, chunk_bounds, forward_logprobs
from unirl.logprobs import LogprobProcessing, logprobs_of
from unirl.packing import enable_packed_attention, pack
from unirl.samples import Sample

QWEN3_VOCAB = 151_936


def direct_logprobs(model, packed, processing=None, with_entropy=True):
    """The pre-chunking ``forward_logprobs`` (its math, without value head / router aux): the oracle."""
    out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                logits_to_keep=packed.target_index)
    logits = out.logits[0].float()
    logp_all = logprobs_of(logits, processing, sampled=packed.target_ids)
    logp = logp_all.gather(-1, packed.target_ids[:, None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = torch.special.entr(logp_all.detach().exp()).sum(-1)
    return logp, entropy


def big_vocab_model(vocab: int = QWEN3_VOCAB, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                      pad_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).float()
    model.config.use_cache = False
    enable_packed_attention(model)
    return model


def samples_of(vocab: int, responses: list[int], seed: int = 1) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [Sample(id=f"s{i}", prompt_ids=torch.randint(2, vocab, (5,), generator=g).tolist(),
                   response_ids=torch.randint(2, vocab, (r,), generator=g).tolist())
            for i, r in enumerate(responses)]


@pytest.fixture
def chunk_64_rows(monkeypatch):
    """A budget of 64 rows of logits per chunk at Qwen3's vocabulary (the default is ~440 rows: a test at
    that size would need thousands of tokens)."""
    monkeypatch.setattr(chunked_logprobs, "CHUNK_BYTES", ROW_ALIGN * 4 * QWEN3_VOCAB)


def peak_bytes(fn) -> int:
    """The peak of torch-allocated bytes during ``fn()`` above what was live at its start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def weighted_backward(logp):
    (logp * torch.linspace(-1.0, 1.0, logp.numel())).sum().backward()


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_chunk_bounds():
    # the default budget: Qwen3's vocabulary at 8 k tokens, chunks of a multiple of ROW_ALIGN rows
    bounds = chunk_bounds(8192, QWEN3_VOCAB)
    sizes = [b - a for a, b in bounds]
    assert bounds[0][0] == 0 and bounds[-1][1] == 8192 and all(a == p[1] for p, (a, _) in zip(bounds, bounds[1:], strict=False))
    assert all(s % ROW_ALIGN == 0 for s in sizes[:-1]) and sizes[-1] >= ROW_ALIGN
    assert max(sizes[:-1]) * QWEN3_VOCAB * 4 <= chunked_logprobs.CHUNK_BYTES and len(bounds) > 8
    # the demo's vocabulary, or logits that fit one chunk: one chunk (the direct path)
    assert chunk_bounds(8192, 259) == [(0, 8192)]
    assert chunk_bounds(300, QWEN3_VOCAB) == [(0, 300)]
    # a short tail joins the chunk before it (a 1- or 2-row GEMM gives other bits than a longer one)
    assert chunk_bounds(130, 1000, budget=64 * 4000) == [(0, 64), (64, 130)]
    assert chunk_bounds(200, 1000, budget=64 * 4000) == [(0, 64), (64, 128), (128, 200)]
    assert chunk_bounds(300, 1000, budget=128 * 4000) == [(0, 128), (128, 192), (192, 300)]
    # a vocabulary so large that one row is over budget: still ROW_ALIGN rows a chunk
    assert chunk_bounds(256, 10**9, budget=1) == [(0, 64), (64, 128), (128, 192), (192, 256)]


@pytest.mark.slow
def test_raw_logprobs_entropy_and_gradients_equal_direct_at_a_fourth_of_the_memory(chunk_64_rows):
    model = big_vocab_model()
    packed = pack(samples_of(QWEN3_VOCAB, [90, 120, 64, 110]))
    assert packed.num_tokens == 384 and len(chunk_bounds(packed.num_tokens, QWEN3_VOCAB)) == 6

    # the replay (no grad): the same bits, at least 4x less peak memory
    with torch.no_grad():
        ref, ref_ent = direct_logprobs(model, packed, with_entropy=False)
        logp, ent, _ = forward_logprobs(model, packed)
        assert ent is None and torch.equal(logp, ref)
        old = peak_bytes(lambda: direct_logprobs(model, packed, with_entropy=False))
        new = peak_bytes(lambda: forward_logprobs(model, packed))
    assert old >= 4 * new, (old, new)
    assert old >= packed.num_tokens * QWEN3_VOCAB * 4  # the measure sees the whole logits

    # a training forward + backward: same log-probs, entropy and gradients, at least 4x less peak memory
    ref, ref_ent = direct_logprobs(model, packed)
    weighted_backward(ref)
    ref_grads = grads(model)
    model.zero_grad(set_to_none=True)
    logp, ent, _ = forward_logprobs(model, packed, with_entropy=True)
    weighted_backward(logp)
    assert torch.equal(logp, ref) and torch.equal(ent, ref_ent)
    assert_grads_equal(grads(model), ref_grads)
    model.zero_grad(set_to_none=True)
    old = peak_bytes(lambda: weighted_backward(direct_logprobs(model, packed)[0]))
    model.zero_grad(set_to_none=True)
    new = peak_bytes(lambda: weighted_backward(forward_logprobs(model, packed, with_entropy=True)[0]))
    assert old >= 4 * new, (old, new)


def assert_grads_equal(got, want):
    assert got.keys() == want.keys()
    for name in want:
        if name == "model.embed_tokens.weight":  # the tied head: its token sum is re-associated per chunk
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6 * want[name].abs().max())
            assert not torch.equal(got[name], torch.zeros_like(got[name]))
        else:
            assert torch.equal(got[name], want[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("processing", [LogprobProcessing(0.7, 50, 0.9), LogprobProcessing(1.3, 20, 1.0)],
                         ids=["top-p", "top-k"])
def test_processed_logprobs_equal_direct(chunk_64_rows, processing):
    model = big_vocab_model()
    packed = pack(samples_of(QWEN3_VOCAB, [70, 80], seed=2))
    assert len(chunk_bounds(packed.num_tokens, QWEN3_VOCAB)) == 2
    ref, ref_ent = direct_logprobs(model, packed, processing)
    weighted_backward(ref)
    ref_grads = grads(model)
    model.zero_grad(set_to_none=True)
    logp, ent, _ = forward_logprobs(model, packed, with_entropy=True, processing=processing)
    weighted_backward(logp)
    assert torch.equal(logp, ref) and torch.equal(ent, ref_ent)
    assert bool(torch.isfinite(logp).all())  # the sampled tokens are kept, even outside top-k / top-p
    assert_grads_equal(grads(model), ref_grads)


def _both_paths(monkeypatch, model, packed, *, value_head=None, aux=False):
    """``forward_logprobs`` + backward on the direct path (one chunk) and on 64-row chunks:
    ``[(logp, entropy, values, aux_loss, grads)]`` for each."""
    vocab = model.get_output_embeddings().weight.shape[0]
    out = []
    for budget in (10**12, ROW_ALIGN * 4 * vocab):
        monkeypatch.setattr(chunked_logprobs, "CHUNK_BYTES", budget)
        model.zero_grad(set_to_none=True)
        router = {} if aux else None
        logp, ent, values = forward_logprobs(model, packed, with_entropy=True, router_aux=router,
                                             value_head=value_head)
        loss = (logp * torch.linspace(-1.0, 1.0, logp.numel())).sum()
        if value_head is not None:
            value_head.zero_grad(set_to_none=True)
            loss = loss + values.square().sum()
        if aux:
            loss = loss + router["aux_loss"]
        loss.backward()
        g = grads(model)
        if value_head is not None:
            g.update({f"value_head.{n}": p.grad.clone() for n, p in value_head.named_parameters()})
        out.append((logp.detach(), ent, None if values is None else values.detach(),
                    router["aux_loss"].detach() if aux else None, g))
    return out


def test_value_head_and_lora_keep_their_bits_in_chunks(monkeypatch):
    from unirl.actor.lora import apply_lora
    from unirl.actor.skeleton import new_value_head
    from unirl.config import LoraSection

    model = big_vocab_model(vocab=512)
    head = new_value_head(64)
    torch.nn.init.normal_(head.weight)
    packed = pack(samples_of(512, [70, 90]))
    (logp, ent, val, _, g), (c_logp, c_ent, c_val, _, c_g) = _both_paths(monkeypatch, model, packed,
                                                                          value_head=head)
    assert len(chunk_bounds(packed.num_tokens, 512, ROW_ALIGN * 4 * 512)) == 2
    assert torch.equal(c_logp, logp) and torch.equal(c_ent, ent) and torch.equal(c_val, val)
    assert_grads_equal(c_g, g)
    assert "value_head.weight" in g

    lora_model = apply_lora(big_vocab_model(vocab=512), LoraSection(r=4), seed=0)
    for p in lora_model.parameters():
        if p.requires_grad:  # peft's lora_B starts at zero: move it, so the adapter's gradients all flow
            torch.nn.init.normal_(p, std=0.02)
    (logp, ent, _, _, g), (c_logp, c_ent, _, _, c_g) = _both_paths(monkeypatch, lora_model, packed)
    assert torch.equal(c_logp, logp) and torch.equal(c_ent, ent)
    assert g.keys() == c_g.keys() and g and all(".lora_" in n for n in g)
    assert all(torch.equal(c_g[n], g[n]) for n in g)  # the head is frozen: every gradient keeps its bits


def test_moe_router_aux_loss_keeps_its_bits_in_chunks(monkeypatch):
    from unirl.config import RunConfig
    from unirl.kernel import load_kernel
    from unirl.models.tokenizer import build_demo_tokenizer

    config = RunConfig.model_validate({"model": {"adapter": "qwen3_moe"}})
    model = load_kernel().build("model_adapters", "qwen3_moe").build_model(config, build_demo_tokenizer()).float()
    enable_packed_attention(model)
    vocab = model.get_output_embeddings().weight.shape[0]
    packed = pack(samples_of(vocab, [70, 90]))
    (logp, ent, _, aux, g), (c_logp, c_ent, _, c_aux, c_g) = _both_paths(monkeypatch, model, packed, aux=True)
    assert aux is not None and torch.equal(c_aux, aux)
    assert torch.equal(c_logp, logp) and torch.equal(c_ent, ent)
    assert_grads_equal(c_g, g)


@pytest.mark.slow
def test_fsdp2_two_ranks_chunked_equals_direct():
    """FSDP2 (gloo, 2 ranks, per-layer units + the root holding the tied head, activation checkpointing):
    the chunks call the head inside the root's forward and recompute it in the backward; the same
    log-probs, entropy, replay and gradients as the direct path on every rank."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent / "chunked_logprobs_fsdp.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["chunks"] >= 3 and r["logp"] and r["entropy"] and r["replay"], r
        assert r["grads_differ"] in ([], ["model.embed_tokens.weight"]) and r["grads_close"], r
