"""The reference ops are batch-invariant: a row's bits depend only on that row (torch.equal)."""

from __future__ import annotations

import pytest
import torch

from unirl_parity_vllm import ops

torch.manual_seed(0)


@pytest.mark.parametrize("k,n", [(128, 384), (384, 128), (128, 300), (128, 64)])
def test_linear_row_alone_equals_row_in_batch_and_at_other_position(k, n):
    w = torch.randn(n, k)
    b = torch.randn(n)
    x = torch.randn(300, k)
    alone = ops.linear(x[5:6], w, b)
    batch37 = ops.linear(x[:37], w, b)
    assert torch.equal(alone[0], batch37[5])
    moved = ops.linear(torch.cat([x[100:137], x[5:6]]), w, b)  # at position 37 of a new batch
    assert torch.equal(alone[0], moved[37])
    big = ops.linear(x, w, b)
    assert torch.equal(big[:37], batch37)
    assert torch.equal(ops.linear(x[None, :37], w, b)[0], batch37)  # leading dims do not matter
    # a fused projection (column slice) equals the separate one
    assert torch.equal(ops.linear(x[:37], w[: n // 2]), ops.linear(x[:37], w)[:, : n // 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_small_row_blocks_give_the_bits_of_the_64_row_block(dtype):
    """Few rows (decode) run in a smaller ``bmm`` block (``ops._row_block``) where this CPU gives it the
    bits of the 64-row block: the same bits alone, in a batch and across the 8 / 16 / 32 / 64 boundaries
    (on an AVX-512 + AMX Xeon 8-row fp32 blocks differ for most of these shapes; the probe skips them)."""
    def blocked(x, w, rb):
        m, k = x.shape
        nb = -(-m // rb)
        xp = torch.cat([x, x.new_zeros((nb * rb - m, k))])
        return torch.bmm(xp.reshape(nb, rb, k), w.t().expand(nb, k, w.shape[0])).reshape(nb * rb, -1)[:m]

    for k, n in [(128, 384), (384, 128), (64, 96), (512, 1536)]:
        w = torch.randn(n, k).to(dtype)
        x = torch.randn(70, k).to(dtype)
        ref = blocked(x.float(), w.float(), ops.ROW_BLOCK).to(dtype)  # bf16 runs in fp32 (ops._linear_fwd)
        for m in (1, 2, 7, 8, 9, 16, 17, 32, 33, 64, 65, 70):
            assert torch.equal(ops.linear(x[:m], w), ref[:m]), (k, n, m)
            assert torch.equal(ops.linear(x[m - 1:m], w)[0], ref[m - 1]), (k, n, m)


def test_a_small_block_that_changes_the_bits_is_not_used(monkeypatch):
    assert ops._row_block(5, 256, 768, torch.float32) in (*ops.SMALL_ROW_BLOCKS, ops.ROW_BLOCK)
    assert ops._row_block(33, 256, 768, torch.float32) == ops.ROW_BLOCK
    # a CPU on which no small block agrees: decode rows go through the 64-row block
    monkeypatch.setattr(ops, "_block_agrees", lambda *a: False)
    assert ops._row_block(5, 256, 768, torch.float32) == ops.ROW_BLOCK
    # one on which only 32 agrees
    monkeypatch.setattr(ops, "_block_agrees", lambda rb, *a: rb == 32)
    assert ops._row_block(5, 256, 768, torch.float32) == 32
    assert ops._row_block(17, 256, 768, torch.float32) == 32


def test_linear_threads_and_autograd():
    w = torch.randn(64, 128, requires_grad=True)
    x = torch.randn(70, 128, requires_grad=True)
    out = ops.linear(x, w)
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(70, 64) @ w.detach(), rtol=1e-5, atol=1e-5)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.linear(x.detach(), w.detach())
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, out.detach())


def test_elementwise_rows():
    x = torch.randn(257, 384) * 4
    w = torch.randn(384)
    assert torch.equal(ops.rms_norm(x[3:4], w, 1e-6)[0], ops.rms_norm(x, w, 1e-6)[3])
    xx = torch.randn(257, 768) * 4
    assert torch.equal(ops.silu_and_mul(xx[3:4])[0], ops.silu_and_mul(xx)[3])
    assert torch.equal(ops.silu_and_mul(xx), ops.silu_mul(xx[:, :384], xx[:, 384:]))
    big = torch.randn(200_001) * 3  # crosses the grain size: split over threads without lanewise
    assert torch.equal(ops.lanewise(torch.nn.functional.silu, big)[-7:],
                       ops.lanewise(torch.nn.functional.silu, big[-7:]))


def test_rope_rows_and_reference():
    cos, sin = ops.rope_cos_sin(32, 10000.0, 512)
    x = torch.randn(50, 4, 32)
    pos = torch.arange(50)
    full = ops.rope(pos, x, cos, sin)
    assert torch.equal(ops.rope(pos[17:18], x[17:18], cos, sin)[0], full[17])
    # same math as transformers' rotate_half form (to rounding)
    c = torch.cat([cos, cos], -1)[pos][:, None]
    s = torch.cat([sin, sin], -1)[pos][:, None]
    rot = torch.cat([-x[..., 16:], x[..., :16]], -1)
    torch.testing.assert_close(full, x * c + rot * s)


def _ref_attention(q, k, v, scale):
    T, Hq, D = q.shape
    kk = k.repeat_interleave(Hq // k.shape[1], dim=1)
    vv = v.repeat_interleave(Hq // k.shape[1], dim=1)
    s = torch.einsum("thd,shd->hts", q, kk) * scale
    s = s.masked_fill(torch.ones(T, k.shape[0], dtype=torch.bool).tril().logical_not(), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), vv)


def test_attention_decode_equals_full_pass_and_reference():
    T = 75  # three key chunks, the last partial
    q, k, v = torch.randn(T, 4, 32), torch.randn(T, 2, 32), torch.randn(T, 2, 32)
    full = ops.attention(q, k, v, torch.arange(T), 32 ** -0.5)
    torch.testing.assert_close(full, _ref_attention(q, k, v, 32 ** -0.5), rtol=1e-5, atol=1e-5)
    for p in (0, 1, 31, 32, 33, 63, 64, 74):  # decode step: one query, the keys so far
        step = ops.attention(q[p:p + 1], k[: p + 1], v[: p + 1], torch.tensor([p]), 32 ** -0.5)
        assert torch.equal(step[0], full[p]), p
    # a prefill of the first 40 then decode (T > 1 with fewer keys than the full pass)
    part = ops.attention(q[:40], k[:40], v[:40], torch.arange(40), 32 ** -0.5)
    assert torch.equal(part, full[:40])


@pytest.mark.parametrize("hq,hkv,d", [(8, 4, 64), (16, 2, 128), (8, 8, 32)])
def test_attention_row_bits_do_not_depend_on_the_gemm_row_count(hq, hkv, d):
    """The attention GEMMs take all ``G x T`` query rows of a kv head at once (``M`` rows); a row's bits
    must not depend on ``M``: one query alone (M = G, padded to 8), inside a prefill of 200 queries
    (M up to 1,600) and at 1 or 2 threads give the same bits."""
    torch.manual_seed(hq + d)
    T = 200
    q, k, v = torch.randn(T, hq, d), torch.randn(T, hkv, d), torch.randn(T, hkv, d)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(ops.attention(q, k, v, torch.arange(T), d ** -0.5))
            for p in (0, 7, 40, 127, 199):
                step = ops.attention(q[p:p + 1], k[: p + 1], v[: p + 1], torch.tensor([p]), d ** -0.5)
                assert torch.equal(step[0], outs[-1][p]), (n, p)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_varlen_equals_per_sequence_and_left_padded_rows():
    lens = [5, 40, 33, 70, 1]
    seqs = [(torch.randn(n, 4, 32), torch.randn(n, 2, 32), torch.randn(n, 2, 32)) for n in lens]
    scale = 32 ** -0.5
    alone = [ops.attention(q, k, v, torch.arange(q.shape[0]), scale) for q, k, v in seqs]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    packed = ops.varlen_attention(*(torch.cat([s[i] for s in seqs]) for i in range(3)), cu, scale)
    assert torch.equal(packed, torch.cat(alone))
    # 37 copies-with-others: the row of sequence 1 is the same wherever it sits
    many = [seqs[i % len(seqs)] for i in range(37)]
    cu37 = torch.tensor([0] + list(torch.tensor([s[0].shape[0] for s in many]).cumsum(0)), dtype=torch.int32)
    packed37 = ops.varlen_attention(*(torch.cat([s[i] for s in many]) for i in range(3)), cu37, scale)
    off = int(cu37[6])  # many[6] is seqs[1]
    assert torch.equal(packed37[off:off + 40], alone[1])
    # left-padded rows (the embedded engine's layout) with a KV cache
    P = 70
    qs, ks, vs, pos, start = [], [], [], [], []
    for q, k, v in seqs:
        n = q.shape[0]
        padq = torch.randn(P - n, 4, 32)  # garbage in pad columns must not leak
        padk = torch.randn(P - n, 2, 32)
        qs.append(torch.cat([padq, q]))
        ks.append(torch.cat([padk, k]))
        vs.append(torch.cat([padk, v]))
        pos.append(torch.cat([torch.zeros(P - n, dtype=torch.long), torch.arange(n)]))
        start.append(P - n)
    rows = ops.attention_rows(torch.stack(qs), torch.stack(ks), torch.stack(vs), torch.stack(pos), scale,
                              key_start=torch.tensor(start))
    for r, n in enumerate(lens):
        assert torch.equal(rows[r, P - n:], alone[r]), r


def test_decode_reads_a_kv_cache_in_place_with_the_same_bits():
    """The embedded engine hands its left-aligned ``[B, Hkv, S_alloc, D]`` cache as a transposed
    view of whole key chunks: the attention reads it without a copy (``ops._kv_rows`` is a view)
    and a decode step gives the bits of the full pass over contiguous keys."""
    B, S, W = 6, 50, 64  # W: the view's width (whole chunks); keys past a row's position are zeros
    q, k, v = torch.randn(B, S, 4, 32), torch.randn(B, S, 2, 32), torch.randn(B, S, 2, 32)
    full = torch.stack([ops.attention(q[b], k[b], v[b], torch.arange(S), 32 ** -0.5) for b in range(B)])
    kc, vc = torch.zeros(B, 2, 96, 32), torch.zeros(B, 2, 96, 32)
    for p in (0, 31, 32, 49):
        kc[:, :, :p + 1], vc[:, :, :p + 1] = k[:, :p + 1].transpose(1, 2), v[:, :p + 1].transpose(1, 2)
        kv, vv = kc[:, :, :W].transpose(1, 2), vc[:, :, :W].transpose(1, 2)
        assert ops._kv_rows(kv, W).data_ptr() == kc.data_ptr()  # no copy
        step = ops.attention_rows(q[:, p:p + 1], kv, vv, torch.full((B, 1), p), 32 ** -0.5)
        assert torch.equal(step[:, 0], full[:, p]), p


def test_decode_rows_at_different_positions_keep_the_bits_of_the_full_pass():
    """A decode step masks with one key row per sequence (``T == 1``: its padded query rows see the
    same keys as its real rows): rows of one batch at different positions, over a shared cache width,
    give the bits of each sequence's full pass (which masks per query row), and the statistics-free
    inference path returns the same output as the one that keeps them."""
    B, S, W = 5, 40, 64
    pos = torch.tensor([0, 31, 32, 39, 10])
    for hq, hkv in ((4, 2), (8, 2), (4, 4)):
        q, k, v = torch.randn(B, S, hq, 32), torch.randn(B, S, hkv, 32), torch.randn(B, S, hkv, 32)
        full = torch.stack([ops.attention(q[b], k[b], v[b], torch.arange(S), 32 ** -0.5) for b in range(B)])
        kc, vc = torch.zeros(B, hkv, W, 32), torch.zeros(B, hkv, W, 32)
        for b in range(B):
            p = int(pos[b])
            kc[b, :, :p + 1], vc[b, :, :p + 1] = k[b, :p + 1].transpose(0, 1), v[b, :p + 1].transpose(0, 1)
        qd = q[torch.arange(B), pos][:, None]
        with torch.inference_mode():
            step = ops.attention_rows(qd, kc.transpose(1, 2), vc.transpose(1, 2), pos[:, None], 32 ** -0.5)
        assert torch.equal(step[:, 0], full[torch.arange(B), pos]), (hq, hkv)
        kept = ops._attention_fwd(qd, kc.transpose(1, 2), vc.transpose(1, 2), pos[:, None], 32 ** -0.5)
        assert kept[1] is not None and torch.equal(kept[0], step)


def test_attention_autograd():
    q = torch.randn(40, 4, 32, requires_grad=True)
    k = torch.randn(40, 2, 32, requires_grad=True)
    v = torch.randn(40, 2, 32, requires_grad=True)
    out = ops.attention(q, k, v, torch.arange(40), 0.2)
    (out ** 2).sum().backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    (_ref_attention(q2, k2, v2, 0.2) ** 2).sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_selected_logprobs_rows():
    logits = torch.randn(300, 1003) * 3
    tok = torch.randint(0, 1003, (300,))
    full = ops.selected_logprobs(logits, tok)
    assert full.dtype == torch.float32
    assert torch.equal(ops.selected_logprobs(logits[7:8], tok[7:8])[0], full[7])
    assert torch.equal(ops.selected_logprobs(logits[:37], tok[:37]), full[:37])


def _plain_attention(q, k, v, q_pos, scale):
    """sdpa-style attention, plain autograd: ``q [T, Hq, D]``, ``k, v [S, Hkv, D]``, query i sees keys <= q_pos[i]."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("thd,shd->hts", q, kk) * scale
    visible = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), vv)


def _grads(fn, inputs, dout):
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*xs)
    out.backward(dout)
    return out.detach(), [x.grad for x in xs]


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 32), (4, 4, 16), (6, 2, 8)])
def test_attention_custom_backward_matches_plain_autograd_float64(hq, hkv, d):
    g = torch.Generator().manual_seed(3)
    lens = [5, 40, 33, 70, 1, 64]
    n = sum(lens)
    q, k, v = (torch.randn(n, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    dout = torch.randn(n, hq, d, generator=g, dtype=torch.float64)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    scale = d ** -0.5
    out, grads = _grads(lambda a, b, c: ops.varlen_attention(a, b, c, cu, scale), (q, k, v), dout)

    def plain(a, b, c):
        outs = [_plain_attention(a[s:e], b[s:e], c[s:e], torch.arange(e - s), scale)
                for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]
        return torch.cat(outs)

    ref, ref_grads = _grads(plain, (q, k, v), dout)
    assert (out - ref).abs().max() < 1e-12
    for a, b in zip(grads, ref_grads, strict=True):
        assert (a - b).abs().max() < 1e-10
    # a decode-style call (T=1, keys 0..p) and left-padded rows go through the same backward
    p = 45
    out1, g1 = _grads(lambda a, b, c: ops.attention(a, b, c, torch.tensor([p]), scale),
                      (q[p:p + 1], k[:p + 1], v[:p + 1]), dout[:1])
    ref1, r1 = _grads(lambda a, b, c: _plain_attention(a, b, c, torch.tensor([p]), scale),
                      (q[p:p + 1], k[:p + 1], v[:p + 1]), dout[:1])
    assert all((a - b).abs().max() < 1e-10 for a, b in zip(g1, r1, strict=True))
    start = torch.tensor([0, 9])
    rows_in = (torch.stack([q[:50], q[50:100]]), torch.stack([k[:50], k[50:100]]), torch.stack([v[:50], v[50:100]]))
    pos = torch.stack([torch.arange(50), (torch.arange(50) - 9).clamp(min=0)])
    _, gr = _grads(lambda a, b, c: ops.attention_rows(a, b, c, pos, scale, key_start=start), rows_in,
                   torch.stack([dout[:50], torch.cat([torch.zeros_like(dout[:9]), dout[59:100]])]))  # pad queries: no grad
    _, rr0 = _grads(lambda a, b, c: _plain_attention(a, b, c, torch.arange(50), scale),
                    (rows_in[0][0], rows_in[1][0], rows_in[2][0]), dout[:50])
    _, rr1 = _grads(lambda a, b, c: _plain_attention(a, b, c, torch.arange(41), scale),
                    (rows_in[0][1, 9:], rows_in[1][1, 9:], rows_in[2][1, 9:]), dout[59:100])
    for i in range(3):
        assert (gr[i][0] - rr0[i]).abs().max() < 1e-10
        assert (gr[i][1, 9:] - rr1[i]).abs().max() < 1e-10


def test_linear_custom_backward_matches_plain_autograd_float64():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 70, 48, generator=g, dtype=torch.float64)
    w = torch.randn(40, 48, generator=g, dtype=torch.float64)
    b = torch.randn(40, generator=g, dtype=torch.float64)
    dout = torch.randn(3, 70, 40, generator=g, dtype=torch.float64)
    out, grads = _grads(ops.linear, (x, w, b), dout)
    ref, ref_grads = _grads(torch.nn.functional.linear, (x, w, b), dout)
    assert (out - ref).abs().max() < 1e-12
    for a, r in zip(grads, ref_grads, strict=True):
        assert (a - r).abs().max() < 1e-10
    _, (gx, gw) = _grads(lambda a, c: ops.linear(a, c), (x, w), dout)  # no bias
    assert (gx - ref_grads[0]).abs().max() < 1e-10 and (gw - ref_grads[1]).abs().max() < 1e-10


def test_forward_bits_do_not_depend_on_grad_mode():
    q, k, v = torch.randn(90, 4, 32), torch.randn(90, 2, 32), torch.randn(90, 2, 32)
    cu = torch.tensor([0, 20, 90], dtype=torch.int32)
    w = torch.randn(64, 128)
    x = torch.randn(70, 128)
    with torch.no_grad():
        a = ops.varlen_attention(q, k, v, cu, 0.2)
        lin = ops.linear(x, w)
    qq = q.clone().requires_grad_()
    assert torch.equal(ops.varlen_attention(qq, k, v, cu, 0.2).detach(), a)
    assert torch.equal(ops.linear(x, w.clone().requires_grad_()).detach(), lin)
