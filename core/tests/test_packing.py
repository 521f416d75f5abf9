"""Packed replay equals per-sample replay; the packed layout is what transformers 5 expects."""

from __future__ import annotations

import pytest
import torch

from unirl import packing
from unirl.actor.torch_actor import forward_logprobs
from unirl.config import RunConfig
from unirl.models.qwen3 import Qwen3Adapter
from unirl.packing import (
    PACKED_ATTENTION,
    PAD_ID,
    UNIFORM_SLACK,
    enable_packed_attention,
    flatten,
    pack,
    slack_for,
)
from unirl.samples import Sample


def tiny_model(seed: int = 0):
    from transformers import Qwen3ForCausalLM

    cfg = Qwen3Adapter().hf_config(RunConfig(), vocab_size=64, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).float().eval()
    model.config.use_cache = False
    return model


def make_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i, (p, r) in enumerate([(3, 5), (1, 1), (6, 0), (2, 7), (4, 3)]):
        prompt = torch.randint(2, 64, (p,), generator=g).tolist()
        resp = torch.randint(2, 64, (r,), generator=g).tolist()
        mask = [1] * r
        if r > 3:
            mask[1] = 0  # a tool-observation token
        out.append(Sample(id=f"p{i}/0", prompt_ids=prompt, response_ids=resp, loss_mask=mask))
    return out


def test_pack_layout():
    samples = make_samples()
    pb = pack(samples)
    T = sum(s.num_tokens for s in samples)
    assert pb.input_ids.shape == (1, T) and pb.position_ids.shape == (1, T)
    assert pb.cu_seqlens.tolist() == [0, 8, 10, 16, 25, 32]
    assert pb.position_ids[0, :10].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    assert pb.response_lens == [5, 1, 0, 7, 3]
    assert pb.num_tokens == 16 and pb.num_seqs == 5
    # each target position holds the token just before the response token it predicts
    ids = pb.input_ids[0]
    assert torch.equal(ids[pb.target_index + 1], pb.target_ids)
    assert pb.seq_index.tolist() == [0] * 5 + [1] + [3] * 7 + [4] * 3
    assert pb.seq_lens.tolist() == [4.0, 1.0, 0.0, 6.0, 3.0]
    assert pb.mask.sum().item() == 14
    parts = pb.split(torch.arange(16.0))
    assert [p.numel() for p in parts] == [5, 1, 0, 7, 3]
    flat = flatten([torch.ones(n) for n in pb.response_lens], pb)
    assert flat.shape == (16,)
    with pytest.raises(ValueError):
        flatten([torch.ones(n + 1) for n in pb.response_lens], pb)


def near_equal_samples(n: int = 12, seed: int = 5) -> list[Sample]:
    """Fixed-length responses after prompts of 9-11 tokens: the padded layout's case."""
    g = torch.Generator().manual_seed(seed)
    return [Sample(id=f"q{i}/0", prompt_ids=torch.randint(2, 64, (9 + i % 3,), generator=g).tolist(),
                   response_ids=torch.randint(2, 64, (16,), generator=g).tolist(), loss_mask=[1] * 16)
            for i in range(n)]


def test_pack_pads_equal_length_rows_only_within_the_slack():
    samples = near_equal_samples()
    lens = [s.num_tokens for s in samples]
    width = max(lens)  # 27, against a mean of 26: 3.8 % padding
    pb = pack(samples, uniform_slack=UNIFORM_SLACK)
    assert pb.input_ids.shape == (1, len(samples) * width)
    assert pb.cu_seqlens.tolist() == [width * i for i in range(len(samples) + 1)]
    assert pb.position_ids[0].tolist() == list(range(width)) * len(samples)
    ids = pb.input_ids[0]
    assert torch.equal(ids[pb.target_index + 1], pb.target_ids)  # targets still index their tokens
    for i, n in enumerate(lens):  # the padding sits at the end of each row
        assert ids[width * i + n : width * (i + 1)].eq(PAD_ID).all()
    plain = pack(samples)
    assert plain.input_ids.shape == (1, sum(lens))
    for name in ("target_ids", "seq_index", "mask", "seq_lens"):
        assert torch.equal(getattr(pb, name), getattr(plain, name)), name
    assert pb.response_lens == plain.response_lens
    # too uneven for the slack (make_samples: 5 sequences of 2-9 tokens): packed as before
    assert pack(make_samples(), uniform_slack=UNIFORM_SLACK).input_ids.shape == (1, 32)
    # only the per-sequence attention gains from it; a whole-row mask would grow with the padding
    model = tiny_model()
    assert slack_for(model) == 0.0
    enable_packed_attention(model)
    assert slack_for(model) == UNIFORM_SLACK
    from unirl.models.qwen3_moe import Qwen3MoeAdapter

    moe = Qwen3MoeAdapter().build_model(RunConfig(model={"adapter": "qwen3_moe"}))
    enable_packed_attention(moe)  # routers see every token of the row: no padding for them
    assert moe.config._attn_implementation == PACKED_ATTENTION and slack_for(moe) == 0.0


@pytest.mark.parametrize("attn", ["sdpa", PACKED_ATTENTION])
def test_padded_rows_give_the_packed_logprobs_and_gradients(attn):
    """No real query attends to the padding (it comes after every real token of its row): under the
    actors' per-sequence attention the log-probs are bitwise equal, and the gradients equal up to the
    summation order of the weight gradients."""
    model = tiny_model()
    if attn == PACKED_ATTENTION:
        assert enable_packed_attention(model)
    model.train()
    samples = near_equal_samples()
    outs = []
    for packed in (pack(samples), pack(samples, uniform_slack=UNIFORM_SLACK)):
        model.zero_grad(set_to_none=True)
        logp, ent, _ = forward_logprobs(model, packed, with_entropy=True)
        (logp * torch.linspace(-1, 1, logp.numel())).sum().backward()
        outs.append((logp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ea, ga), (b, eb, gb) = outs
    if attn == PACKED_ATTENTION:  # what the actors run: the same per-sequence kernels, the same bits
        assert torch.equal(a, b) and torch.equal(ea, eb)
    else:  # one mask over the whole row: more (masked) keys per query change the summation order only
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
        torch.testing.assert_close(eb, ea, atol=1e-5, rtol=0)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], atol=1e-5, rtol=1e-5, msg=n)


def test_transformers_detects_packing():
    from transformers.masking_utils import find_packed_sequence_indices

    pb = pack(make_samples())
    seqs = find_packed_sequence_indices(pb.position_ids)
    assert seqs is not None
    expect = torch.repeat_interleave(torch.arange(5), torch.diff(pb.cu_seqlens.long()))
    assert torch.equal(seqs[0], expect)


def test_empty_prompt_rejected():
    with pytest.raises(ValueError):
        pack([Sample(id="p0/0", prompt_ids=[], response_ids=[3], loss_mask=[1])])


@pytest.mark.parametrize("attn", ["sdpa", "eager", PACKED_ATTENTION])
def test_packed_equals_unpacked(attn):
    model = tiny_model()
    if attn == PACKED_ATTENTION:  # what every actor runs: attention per packed sequence
        assert enable_packed_attention(model)
    else:
        model.set_attn_implementation(attn)
    assert model.config._attn_implementation == attn
    samples = make_samples()
    with torch.no_grad():
        packed_logp, packed_ent, _ = forward_logprobs(model, pack(samples), with_entropy=True)
        per = []
        per_ent = []
        for s in samples:
            # unpacked reference: plain full-logits forward on the single sequence
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            P = len(s.prompt_ids)
            tgt = torch.tensor(s.response_ids, dtype=torch.long)
            rows = lp[P - 1 : P - 1 + len(s.response_ids)]
            per.append(rows.gather(-1, tgt[:, None])[:, 0])
            per_ent.append(-(rows.exp() * rows).sum(-1))
    ref = torch.cat(per)
    assert packed_logp.shape == ref.shape
    torch.testing.assert_close(packed_logp, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(packed_ent, torch.cat(per_ent), atol=1e-5, rtol=0)
    # and packing is not a no-op: an unmasked (plain causal) row would differ
    pb = pack(samples)
    with torch.no_grad():
        leaky = model(input_ids=pb.input_ids, use_cache=False).logits[0].float()
    leaky_lp = torch.log_softmax(leaky, -1)[pb.target_index].gather(-1, pb.target_ids[:, None])[:, 0]
    assert (leaky_lp - ref).abs().max() > 1e-3


def test_length_buckets_bound_the_padding_and_keep_one_group_in_packed_order():
    assert packing._buckets([346, 60, 346, 60]) == [[0, 2], [1, 3]]
    assert packing._buckets([8, 10, 9, 8]) == [[0, 1, 2, 3]]  # all within the ratio: packed order, no permutation
    lens = [5, 100, 74, 75, 56, 57, 1, 42, 100]
    groups = packing._buckets(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:  # nobody padded past 1 / BUCKET_RATIO of its own length
        assert all(lens[i] >= packing.BUCKET_RATIO * max(lens[j] for j in g) for i in g), (g, lens)
    assert [[lens[i] for i in g] for g in groups] == [[100, 75, 100], [74, 56, 57], [42], [5], [1]]


def test_mixed_lengths_attend_in_buckets_with_the_one_bucket_logprobs_and_gradients(monkeypatch):
    """A batch of long and short sequences (an SFT batch of tool traces and direct answers): the short ones
    are no longer padded to the long ones (the attention calls show it), and the log-probs and gradients
    equal a single padded group's."""
    g = torch.Generator().manual_seed(5)
    samples = [Sample(id=f"p{i}/0", prompt_ids=torch.randint(2, 64, (4,), generator=g).tolist(),
                      response_ids=torch.randint(2, 64, (40 if i % 2 else 6,), generator=g).tolist())
               for i in range(8)]
    model = tiny_model()
    assert enable_packed_attention(model)
    model.train()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    shapes = []

    def spy(q, *a, **kw):
        shapes.append(tuple(q.shape))
        return sdpa(q, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    outs = []
    for ratio in (packing.BUCKET_RATIO, 0.0):  # 0: every sequence joins the first group (the old padding)
        monkeypatch.setattr(packing, "BUCKET_RATIO", ratio)
        shapes.clear()
        model.zero_grad(set_to_none=True)
        logp, _, _ = forward_logprobs(model, pack(samples))
        (logp * torch.linspace(-1, 1, logp.numel())).sum().backward()
        outs.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, list(shapes)))
    (a, ga, bucketed), (b, gb, single) = outs
    layers = model.config.num_hidden_layers
    assert [s[0] for s in bucketed[:2]] == [4, 4] and [s[2] for s in bucketed[:2]] == [44, 10]
    assert len(bucketed) == 2 * layers and len(single) == layers and single[0][2] == 44
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], atol=1e-5, rtol=1e-5, msg=n)


def test_sequence_plan_is_built_once_per_forward_and_rebuilt_for_new_or_edited_positions(monkeypatch):
    """Every attention layer gets the same ``position_ids``: the plan is built once per forward (it was once
    per layer), a new batch builds a new one, and an in-place edit of the positions is not served stale."""
    built = []
    real = packing._build_plan
    monkeypatch.setattr(packing, "_build_plan", lambda *a: built.append(1) or real(*a))
    samples = [Sample(id=f"p{i}/0", prompt_ids=[3, 4, 5, 6], response_ids=list(range(2, 2 + (40 if i % 2 else 6))))
               for i in range(4)]
    model = tiny_model()
    assert enable_packed_attention(model)
    with torch.no_grad():
        forward_logprobs(model, pack(samples))
        assert len(built) == 1 and model.config.num_hidden_layers > 1
        forward_logprobs(model, pack(samples))
    assert len(built) == 2
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert packing._sequence_plan(pos, 1, 6)[0] == 3
    pos[0, 5] = 2  # in place: sequences [0, 1, 2] and [0, 1, 2]
    assert packing._sequence_plan(pos, 1, 6)[0] == 2 and len(built) == 4


def test_sft_loss_computes_only_the_masked_in_logits_with_the_same_loss_and_gradients(monkeypatch):
    """``PackedBatch.masked_in``: SFT's cross-entropy asks the model for the logits of the masked-in response
    tokens only (an agentic trace's observations are most of its response), and its loss and gradients
    equal the full-response forward's masked sum (the oracle)."""
    from unirl.actor.skeleton import sft_micro_batch_loss

    samples = make_samples()
    for s in samples[:2]:
        s.loss_mask = [0] * len(s.response_ids)  # a sample with nothing to learn from
    model = tiny_model()
    enable_packed_attention(model)
    full = pack(samples)
    total = float(full.mask.sum())
    logp, _, _ = forward_logprobs(model, full)
    ref = -(logp * full.mask).sum() / total
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    kept = []
    real = model.lm_head.forward
    monkeypatch.setattr(model.lm_head, "forward", lambda h: kept.append(h.shape[-2]) or real(h))
    loss, metrics = sft_micro_batch_loss(model, samples, total_tokens=total)
    loss.backward()
    assert kept == [int(total)] and total < full.num_tokens, (kept, total, full.num_tokens)
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=0)
    for p, g in zip(model.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)
    m = full.masked_in()
    assert m.response_lens == [int(n) for n in full.seq_lens] and m.mask.eq(1).all()
    assert m.split(torch.ones(m.num_tokens))[0].numel() == 0  # an all-masked sample keeps an empty slot
