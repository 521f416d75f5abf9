"""The MoE reference math of :mod:`unirl_parity_vllm.moe`, against independent oracles.

* top-k tie-break: equal probabilities pick the lowest expert index, whatever ``torch.topk`` does;
* :func:`route` + :func:`expert_combine` equal a float64 per-token loop (softmax, top-k, renormalise,
  SiLU-gated experts) to fp32 rounding, and transformers' own Qwen3-MoE forward to 1e-5;
* batch invariance: a row's routing and output are bit-identical alone, inside a batch, at any
  position; a packed replay of several sequences is bit-identical to each sequence alone;
* routing_stats counts top-k *set* differences (order inside a set does not count) and expert load.
"""

from __future__ import annotations

import torch

from unirl_parity_vllm import moe


def _weights(E=8, H=64, inner=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, H, generator=g) * 0.3, torch.randn(E, 2 * inner, H, generator=g) * 0.1,
            torch.randn(E, H, inner, generator=g) * 0.1)


def test_topk_tie_break_is_lowest_index():
    x = torch.zeros(3, 4)
    gate = torch.zeros(6, 4)  # all logits equal: every expert ties
    _, w, ids = moe.route(x, gate, 2, True)
    assert ids.tolist() == [[0, 1]] * 3 and torch.equal(w, torch.full((3, 2), 0.5))
    gate[4] = 1.0
    _, _, ids = moe.route(torch.ones(1, 4), gate, 2, True)
    assert ids.tolist() == [[4, 0]]


def test_route_and_combine_match_float64_loop():
    gate, w13, w2 = _weights()
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(1))
    logits, w, ids = moe.route(x, gate, 2, True)
    out = moe.expert_combine(x, ids, w, w13, w2)
    xd, gd, w13d, w2d = x.double(), gate.double(), w13.double(), w2.double()
    ref = torch.zeros_like(xd)
    for t in range(x.shape[0]):
        p = torch.softmax(xd[t] @ gd.T, -1)
        top = sorted(range(8), key=lambda e: (-p[e].item(), e))[:2]
        assert set(top) == set(ids[t].tolist())
        z = p[top].sum()
        for e in top:
            h = w13d[e] @ xd[t]
            gate_h, up = h[:32], h[32:]
            ref[t] += (p[e] / z) * (w2d[e] @ (torch.nn.functional.silu(gate_h) * up))
    assert torch.allclose(out.double(), ref, atol=1e-6, rtol=1e-5)


def test_row_invariant_alone_in_batch_and_any_position():
    gate, w13, w2 = _weights(seed=2)
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(3))
    _, w, ids = moe.route(x, gate, 2, True)
    full = moe.expert_combine(x, ids, w, w13, w2)
    for r in (0, 7, 150, 299):
        # alone, first of a batch of 41, last of a batch of 92
        for rows, j in ((x[r:r + 1], 0), (torch.cat([x[r:r + 1], x[:40]]), 0), (torch.cat([x[:91], x[r:r + 1]]), 91)):
            _, w1, i1 = moe.route(rows, gate, 2, True)
            o1 = moe.expert_combine(rows, i1, w1, w13, w2)
            assert torch.equal(i1[j], ids[r]) and torch.equal(o1[j], full[r])


def test_transformers_moe_under_provider_packed_equals_single_and_hf():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from unirl.api import RunConfig

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                         max_position_embeddings=512)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 33, 70, 12)]
    with torch.no_grad():
        hf = torch.cat([model(torch.tensor([s])).logits[0] for s in seqs])
    provider = moe.Qwen3MoeParityProvider(config=RunConfig())
    with provider.exact_context("replay"), torch.no_grad():
        single = torch.cat([model(torch.tensor([s])).logits[0] for s in seqs])
        ids = torch.tensor([[t for s in seqs for t in s]])
        pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        with moe.recording() as rec:
            packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    assert not moe.installed()
    assert torch.equal(single, packed)
    assert torch.allclose(single, hf, atol=1e-5)
    routing = rec.by_layer()
    assert len(routing) == 2 and all(r.shape == (ids.shape[1], 2) for r in routing.values())


def test_routing_stats_counts_set_differences():
    a = {0: torch.tensor([[0, 1], [2, 3], [4, 5]]), 1: torch.tensor([[1, 0], [1, 2], [3, 4]])}
    b = {0: torch.tensor([[1, 0], [2, 3], [4, 6]]), 1: torch.tensor([[0, 1], [2, 1], [3, 4]])}
    s = moe.routing_stats(a, b, 8)
    assert s["tokens"] == 3 and s["mismatch_tokens"] == 1 and abs(s["mismatch_fraction"] - 1 / 3) < 1e-12
    assert s["expert_load"]["0"] == [round(1 / 6, 6)] * 6 + [0.0, 0.0]  # rounded to 6 digits
    s = moe.routing_stats(a, b, 8, mask=torch.tensor([True, True, False]))
    assert s["tokens"] == 2 and s["mismatch_tokens"] == 0


def test_prefix_keyed_routing_record_file_reader_and_gate_compare(tmp_path, monkeypatch):
    """The per-step diagnostics' plumbing (:mod:`unirl_parity_vllm.routing`) without a model: engine
    records filed by prefix hash (to a file, as an engine process does), a torn record read later, a
    fresh run skipping older records, and the gate's counts against a hand-made replay: equal sets in
    another slot order count as equal, one changed expert counts once, a token without a record is
    ``missing``, load counts the replay's assignments over loss tokens only."""
    from types import SimpleNamespace

    from unirl.api import Sample
    from unirl_parity_vllm import routing

    assert routing.prefix_keys([5, 7]) == [routing.roll(0, 5), routing.roll(routing.roll(0, 5), 7)]
    assert routing.prefix_keys([5, 7])[1] != routing.prefix_keys([7, 5])[1]
    config = SimpleNamespace(run_dir=tmp_path / "run")
    monkeypatch.setenv("UNIRL_PARITY_DIR", str(tmp_path / "parity"))
    routing.SINK.add([123], torch.tensor([[[0, 1], [2, 3]]]))  # an older run's record
    routing.reset(config)
    a = Sample(id="a", prompt_ids=[1, 2], response_ids=[3, 4, 5], loss_mask=[1, 0, 1])
    keys = routing.prefix_keys([1, 2, 3, 4, 5])
    # rows predicting response tokens 0 and 2 (input positions 1 and 3); token 1 is not the policy's
    routing.SINK.add([keys[1]], torch.tensor([[[1, 0], [2, 3]]]))
    path = next((tmp_path / "parity" / "routing").glob("*.pkl"))
    with open(path, "ab") as f:
        f.write(b"\x80\x05garbage")  # a record being appended right now
    assert routing.attach([a], config) == {"found": 1, "missing": 1}
    with open(path, "r+b") as f:  # the append completes
        f.truncate(path.stat().st_size - len(b"\x80\x05garbage"))
    routing.SINK.add([keys[3]], torch.tensor([[[4, 5], [6, 7]]]))
    assert routing.attach([a], config) == {"found": 2, "missing": 0}
    assert a.meta["parity_routing"] == [[[1, 0], [2, 3]], None, [[4, 5], [6, 7]]]
    assert routing.reader(config).lookup(123) is None  # the older run's record was skipped
    b = Sample(id="b", prompt_ids=[9], response_ids=[8], loss_mask=[1])  # no engine record at all
    # the packed replay's rows: a = positions 0..4, b = 5..6; loss rows a:1, a:3, b:5
    replay = {0: torch.tensor([[7, 7], [0, 1], [7, 7], [4, 5], [7, 7], [3, 2], [7, 7]]),
              1: torch.tensor([[7, 7], [3, 2], [7, 7], [6, 0], [7, 7], [1, 0], [7, 7]])}
    got = routing.compare([a, b], replay, num_experts=8)
    assert got == {"tokens": 2, "mismatch_tokens": 1, "missing": 1,
                   "load": {"0": [1, 1, 1, 1, 1, 1, 0, 0], "1": [2, 1, 1, 1, 0, 0, 1, 0]}}
    assert routing.compare([a, b], {0: replay[0][:5]}, num_experts=8) is None  # rows of another batch
    total = routing.summary(routing.merge(got, got), num_experts=8)
    assert total["mismatch_fraction"] == 0.5 and total["expert_load"]["0"][0] == round(1 / 6, 6)
    assert total["max_load_vs_uniform"]["1"] == round(4 * 8 / 12, 6)
