"""Batch-invariant reference ops: pure torch, autograd-able, the same bits on every side.

The trainer (inside :meth:`ParityProvider.exact_context`), the embedded torch engine and vLLM (through
``unirl_parity_vllm.vllm_side``) all compute a Qwen3 forward with these functions, so a token's
log-prob depends only on the model, the weights and that token's own sequence: never on how many
rows are batched, their order, padding or packing.

**Invariant by construction.** A row's result depends only on that row's inputs. Each op is written
so that the floating-point operations applied to one row, and their order, are fixed by the row alone:

* :func:`linear` - ``torch.bmm`` over fixed blocks of :data:`ROW_BLOCK` rows (the last block
  zero-padded). Measured on this CPU (torch 2.13, 2 threads, AVX2 capability): plain ``F.linear``
  gives a row different bits at ``M = 1`` than at any ``M >= 2`` and at 28 of 28 probed positions in a
  batch of 1,024, for every shape probed (K, N in 64..768); one fixed GEMM shape per block makes the
  kernel choice constant, and then a row's bits were identical alone, in a batch of 2..4,096 rows, at
  any position of its block, on 1 or 2 threads, and for any column slice of the weight (so a fused
  ``qkv`` / ``gate_up`` projection equals the separate ones). Cost: block 64 runs at 0.9-1.0x of
  ``F.linear`` at 64 rows and 1.1-1.3x at 4,500 rows (blocks 16/32 cost more, 128/256 more at small M).
  Fewer than 64 rows (a decode step) run in one block of 8, 16 or 32 rows instead (:func:`_row_block`),
  where that block gives the bits of the 64-row one on this CPU for this shape: one probe per shape
  (:func:`_block_agrees`). Every block agreed on an AVX2 CPU, but not on an AVX-512 + AMX one. 16 rows
  padded to 64 cost 2-2.5x ``F.linear``.
* transcendental elementwise ops (``silu``, ``exp``, ``cos``/``sin``) - :func:`lanewise`: ATen's
  vectorised loop handles ``2 x Vec::size()`` elements per iteration and falls back to scalar code
  for the remainder (and for the remainder of every thread's slice when a tensor over 32,768
  elements is split across threads). The scalar and vector versions differ: ``silu`` and ``sigmoid``
  differed on 1 of 64 probed values. So these ops run on a contiguous, zero-padded buffer whose size
  is a multiple of 64 and, when larger than ATen's grain size, in 32,768-element pieces: every element
  takes the vector path, wherever it sits.
* :func:`rms_norm` - transformers' formula (mean over the row, ``rsqrt``, both correctly rounded
  per element or reduced within the row).
* :func:`attention` - split-KV attention over fixed chunks of :data:`KEY_CHUNK` keys counted from
  the sequence start; the scores are one ``torch.bmm`` over all of a kv head's keys and the value
  sums one per chunk (fixed reduction sizes: ``D``, then the chunk's 32 keys; a row's bits measured
  independent of the GEMM's row count (>= 4), of the column slice and of the operands' strides, as
  for :func:`linear`; so a KV cache is read in place), the softmax is two-pass (exact max over all
  chunks, then ``exp`` through :func:`lanewise`, sums over the chunk's 32 keys), and chunk partial
  sums are combined left to right in Python. A query never depends on the chunks it cannot see
  except through exact zeros, so a decode step (T=1, keys 0..p) and a full teacher-forced pass give
  identical bits. (Until 2026-12-01 the products were elementwise and summed over the innermost dim:
  the same invariance, 3x slower, memory-bound. Later that day, every chunk still had its own score GEMM
  on a zero-padded copy of the keys and decode rows were padded to 8: the same bits, checked
  ``torch.equal`` against that layout over 120 shapes.)
* :func:`selected_logprobs` - ``log_softmax`` over the vocabulary, one row at a time by ATen's
  row-wise kernel (a row's reduction order depends only on V); processed (``processed_logprobs``):
  the fp32 division by the temperature, then :func:`apply_top_k_top_p` (sort, softmax and cumsum of
  one row: row-local), then the same ``log_softmax``. Core's :mod:`unirl.logprobs`, re-exported.

Backward: :func:`linear` and the attention are ``torch.autograd.Function``s whose forward is the
invariant computation above and whose backward is the standard one (plain GEMMs; the attention
recomputes the softmax from the saved ``q``, ``k`` and row statistics). Backward is correct, not
batch-invariant or bit-matched to anything (nothing compares gradients across sides). The other ops
are differentiated by ordinary autograd.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from unirl.api import LogprobProcessing, apply_top_k_top_p
from unirl.api import selected_logprobs as _core_selected_logprobs

#: rows per GEMM block in :func:`linear` (measured: see the module doc)
ROW_BLOCK = 64
#: smaller blocks for few rows (decode), each used only where it gives the bits of :data:`ROW_BLOCK`
#: (see :func:`_row_block`)
SMALL_ROW_BLOCKS = (8, 16, 32)
#: keys per attention chunk; chunk 0 starts at the sequence's first token
KEY_CHUNK = 32
#: the query rows of an attention GEMM are padded to a multiple of this (see :func:`_attn_rows`)
ATTN_ROWS = 8
#: ... or to this many when there are at most this many (a decode step); fewer rows change the bits
ATTN_MIN_ROWS = 4
#: product elements per tile of the attention forward (4 MiB of fp32): cache-sized buffers
ATTN_TILE_ELEMENTS = 1 << 20
#: elements per piece in :func:`lanewise`: ATen's grain size, so one piece never splits across threads
LANE_PIECE = 32768
#: every lanewise buffer is padded to a multiple of this (>= 2 x widest Vec::size() for fp32/bf16)
LANE_ALIGN = 64


def lanewise(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """Apply the elementwise ``fn`` so that every element takes ATen's vectorised path (module doc)."""
    shape = x.shape
    flat = x.contiguous().reshape(-1)
    n = flat.numel()
    pad = (-n) % LANE_ALIGN
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if flat.numel() <= LANE_PIECE:
        out = fn(flat)
    else:
        out = torch.cat([fn(p) for p in torch.split(flat, LANE_PIECE)])
    return out[:n].reshape(shape)


def _lanewise_exp_(x: Tensor) -> Tensor:
    """``exp`` in place with :func:`lanewise`'s guarantee: ``x`` contiguous with a size that is a
    multiple of :data:`LANE_ALIGN` is exponentiated in the same :data:`LANE_PIECE` pieces, so every
    element takes the vectorised path (the attention's scores always qualify: ``Mp x L`` is a multiple
    of 128). Anything else goes through :func:`lanewise` (a copy)."""
    if not x.is_contiguous() or x.numel() % LANE_ALIGN:
        return lanewise(torch.exp, x)
    if x.numel() <= LANE_PIECE:  # one piece (a decode step): no split
        return x.exp_()
    for piece in torch.split(x.view(-1), LANE_PIECE):
        piece.exp_()
    return x


def _row_block(m: int, k: int, n: int, dtype: torch.dtype) -> int:
    """Rows per ``bmm`` block for ``m`` rows of a ``[n, k]`` weight: :data:`ROW_BLOCK`, or the smallest
    of :data:`SMALL_ROW_BLOCKS` that holds all ``m`` and gives the bits of the :data:`ROW_BLOCK` block
    here (:func:`_block_agrees`). Decode steps need the small blocks: 16 rows padded to 64 cost 2-2.5x
    ``F.linear``."""
    if m <= SMALL_ROW_BLOCKS[-1]:
        threads = torch.get_num_threads()
        for rb in SMALL_ROW_BLOCKS:
            if m <= rb and _block_agrees(rb, k, n, dtype, threads):
                return rb
    return ROW_BLOCK


@functools.cache
def _block_agrees(rb: int, k: int, n: int, dtype: torch.dtype, threads: int) -> bool:
    """Whether one ``bmm`` block of ``rb`` rows gives a row the bits of the :data:`ROW_BLOCK` block, for
    a ``[n, k]`` weight at this thread count, on this CPU: one probe on fixed random data, once per
    shape. The kernel that the GEMM picks, and with it the order of the sums, depends on the CPU and the
    shape, not on the data, so one random probe tells them apart. Measured: on an AVX2 CPU every block
    of 8..512 rows agreed with 64 (fp32 / bf16 / fp64, 1 and 2 threads). On an AVX-512 + AMX Xeon,
    8-row fp32 blocks differed for most shapes, and 16 and 32 for ``k=2048, n=512`` on 2 threads."""
    g = torch.Generator().manual_seed(rb * 1_000_003 + k * 1_009 + n)  # never the global generator
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(1, k, generator=g).to(dtype)
    wt = w.t()

    def one_block(rows: int) -> Tensor:
        xp = torch.cat([x, x.new_zeros((rows - 1, k))])
        return torch.bmm(xp[None], wt.expand(1, *wt.shape))[0, :1]

    return torch.equal(one_block(rb), one_block(ROW_BLOCK))


def _linear_fwd(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The row-invariant GEMM (module doc). bf16 / fp16 run in fp32 and round once at the end: on an
    AVX-512 + AMX Xeon the bf16 ``bmm`` gives a row different bits at different positions of the same
    64-row block (``k=512, n=1536``: 1 to 4 of 12 probed rows, depending on the data), so no block size
    makes it row-invariant there. The fp32 GEMM is row-invariant there, as on AVX2. The cost is an fp32
    copy of the weight on each call."""
    lead = x.shape[:-1]
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if m == 0:
        out = rows.new_zeros((0, weight.shape[0]))
    else:
        dtype = rows.dtype
        if dtype.itemsize < 4:
            rows, weight = rows.float(), weight.float()
        rb = _row_block(m, k, weight.shape[0], rows.dtype)
        blocks = -(-m // rb)
        pad = blocks * rb - m
        if pad:
            rows = torch.cat([rows, rows.new_zeros((pad, k))])
        wt = weight.t()
        out = torch.bmm(rows.reshape(blocks, rb, k), wt.expand(blocks, *wt.shape))
        out = out.reshape(blocks * rb, -1)[:m].to(dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


class _Linear(torch.autograd.Function):
    """Forward: :func:`_linear_fwd` (the invariant bits). Backward: two plain GEMMs. Autograd through
    the blocked ``bmm`` would materialise a ``[blocks, K, N]`` weight gradient and sum it."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear_fwd(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, weight.shape[0])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (g @ weight).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            gw = g.t() @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum(0)
        return gx, gw, gb


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T (+ bias)`` for ``x [..., K]``, ``weight [N, K]``: row-invariant (module doc).
    Differentiable: the backward is the standard one (two GEMMs), not batch-invariant (it need not be)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _Linear.apply(x, weight, bias)
    return _linear_fwd(x, weight, bias)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3 / Llama RMSNorm over the last dim (fp32 statistics, transformers' formula)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(dtype)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` with a row-invariant silu."""
    return lanewise(F.silu, gate) * up


def silu_and_mul(x: Tensor) -> Tensor:
    """vLLM's ``SiluAndMul``: ``x [..., 2I]`` (gate first, then up) -> ``[..., I]``."""
    i = x.shape[-1] // 2
    return silu_mul(x[..., :i], x[..., i:])


@functools.lru_cache(maxsize=16)
def _rope_cache(head_dim: int, base: float, max_positions: int) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    t = torch.arange(max_positions, dtype=torch.float)
    freqs = t[:, None] * inv_freq[None, :]  # exact products, like vLLM's einsum("i,j->ij")
    return lanewise(torch.cos, freqs), lanewise(torch.sin, freqs)


def rope_cos_sin(head_dim: int, base: float, max_positions: int) -> tuple[Tensor, Tensor]:
    """The ``cos, sin [max_positions, head_dim / 2]`` tables :func:`rope` indexes (default RoPE,
    vLLM's ``RotaryEmbedding._compute_cos_sin_cache`` formula). Cached; do not modify."""
    return _rope_cache(int(head_dim), float(base), int(max_positions))


def rope(positions: Tensor, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox-style RoPE (rotate halves, as Qwen3): ``x [T, heads, D]`` at ``positions [T]``."""
    half = x.shape[-1] // 2
    c = cos[positions].to(x.dtype)[:, None, :]
    s = sin[positions].to(x.dtype)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _attn_rows(m: int) -> int:
    """Query rows of one attention GEMM for ``m`` real rows: :data:`ATTN_MIN_ROWS` when ``m`` is at
    most that (a decode step: ``G`` rows), else ``m`` rounded up to :data:`ATTN_ROWS`. Measured
    (``torch.bmm``, fp32, D 32..128, 1..1,024 batches, 1 and 2 threads): fewer than 4 rows take other
    kernels and other bits; 4, 8, 12, ... rows give a row the bits it has among 64 rows."""
    if m <= ATTN_MIN_ROWS:
        return ATTN_MIN_ROWS
    return -(-m // ATTN_ROWS) * ATTN_ROWS


def _kv_rows(x: Tensor, n_keys: int) -> Tensor:
    """``x [B, S, Hkv, D]`` as ``[B * Hkv, n_keys, D]`` (``n_keys`` a whole number of chunks >= ``S``),
    zero past key ``S``. A view when ``S == n_keys`` and ``x`` is a transposed view of a
    ``[B, Hkv, S', D]`` KV cache (the embedded engine's decode), else one copy. Both operands of the
    attention GEMMs are read from this layout: the keys transposed (``[D, L]``, a strided view), the
    values one chunk at a time; measured, the GEMM bits do not depend on these strides."""
    B, S, H, D = x.shape
    xp = x.permute(0, 2, 1, 3)
    if S == n_keys:
        return xp.reshape(B * H, S, D)
    out = x.new_zeros((B, H, n_keys, D))
    out[:, :, :S].copy_(xp)
    return out.view(B * H, n_keys, D)


def _attention_block(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, stats: bool = True
                     ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The invariant computation: ``q [B, T, Hq, D]``, ``k, v [B, S, Hkv, D]`` with key ``j`` of row ``b`` at
    position ``j`` of that row's sequence, ``q_pos [B, T]``. Query ``i`` sees keys ``j <= q_pos[i]``.
    Returns the output and the softmax statistics ``m`` (row max) and ``den`` (sum of ``exp(s - m)``),
    both ``[B, T, Hkv, G]``, which the backward uses.

    Products are ``torch.bmm`` per (sequence, kv head): the ``G x T`` query rows of a kv head (padded
    by :func:`_attn_rows`) against all its keys, padded to whole chunks of :data:`KEY_CHUNK`,
    ``[M, D] @ [D, L]`` (a score's bits do not depend on ``L``: a column slice of a GEMM is
    invariant, as for :func:`linear`), then per chunk the probabilities against that chunk's values,
    ``[M, C] @ [C, D]``. The reduction dims (``D``, then ``C``) are fixed; a row's bits do not depend
    on ``M`` (the property :func:`linear`'s small row blocks rest on; measured for attention over
    M = 4..1,600 rows, D 32..128, 1 and 2 threads, against one fixed 8-row block: identical;
    ``tests/test_ops.py`` checks decode = full pass = batched rows, and these bits against the earlier
    per-chunk layout). ``stats=False`` (no backward will follow) returns ``None`` for ``m`` and ``den``.

    A decode step (``T == 1``) masks with one ``[B, L]`` row per sequence: its padded query rows
    (zeros) see the same keys as its real rows instead of key 0 only. Their results are discarded, and
    a row's bits do not depend on the other rows of its GEMM, so the real rows keep their bits (checked
    ``torch.equal`` against the full pass, which masks per query row, in ``tests/test_ops.py``, and
    against the previous per-row decode mask over 1,370 cases; ``docs/parity.md``); it saves building and applying
    a ``[B, Mp, L]`` mask and the padded positions on every layer of every step."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    C = KEY_CHUNK
    n_chunks = max(1, -(-S // C))
    L = n_chunks * C
    M = G * T  # query rows of one (sequence, kv head): head-major, then query
    Mp = _attn_rows(M)
    BH = B * Hkv
    heads = q.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    if T == 1:  # decode: one mask row per sequence, padded rows included (see the doc)
        row_pos = q_pos
    else:
        row_pos = q_pos[:, None, :].expand(B, G, T).reshape(B, M)
    if Mp != M:  # padded rows: zeros, finite, discarded (for T > 1 they see key 0 only)
        rows = q.new_zeros((BH, Mp, D))
        rows.view(B, Hkv, Mp, D)[:, :, :M].view(B, Hkv, G, T, D).copy_(heads)
        if T > 1:
            row_pos = torch.cat([row_pos, row_pos.new_zeros((B, Mp - M))], dim=1)
    else:
        rows = heads.reshape(BH, M, D)
    kr = _kv_rows(k, L)  # [BH, L, D]
    vr = _kv_rows(v, L)
    # s is this call's own buffer: scale, mask, shift and exp in place (the same values, fewer passes)
    s = torch.bmm(rows, kr.transpose(1, 2)).mul_(scale).view(B, Hkv, Mp, L)
    hidden = torch.arange(L, device=q.device)[None, None, :] > row_pos[:, :, None]  # [B, Mp or 1, L]
    s.masked_fill_(hidden[:, None], -math.inf)
    m = s.amax(dim=-1)  # [B, Hkv, Mp]; exact: max is order-free
    p = _lanewise_exp_(s.sub_(m[..., None])).view(BH, Mp, n_chunks, C)
    part_den = p.sum(-1)  # [BH, Mp, nC]: inner sums of C
    num, den = torch.bmm(p[:, :, 0], vr[:, :C]), part_den[:, :, 0]
    for c in range(1, n_chunks):  # chunks combined left to right
        num = num + torch.bmm(p[:, :, c], vr[:, c * C:(c + 1) * C])
        den = den + part_den[:, :, c]
    out = num.div_(den[..., None]).view(B, Hkv, Mp, D)[:, :, :M]  # num: this call's own sum
    out = out.reshape(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)
    if not stats:
        return out, None, None

    def stat(t: Tensor) -> Tensor:  # [B, Hkv, Mp] -> [B, T, Hkv, G]
        return t.reshape(B, Hkv, Mp)[:, :, :M].reshape(B, Hkv, G, T).permute(0, 3, 1, 2)

    return out, stat(m), stat(den)


def _attention_fwd(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, stats: bool = True
                   ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """:func:`_attention_block` over tiles: query slices of :data:`KEY_CHUNK` rows, each given only
    the key chunks its queries can see, in row groups of at most :data:`ATTN_TILE_ELEMENTS` product
    elements. The same bits as one call: a query's result depends only on its own row and on the
    chunks it can see (a fully masked chunk adds exact zeros, which is why a decode step equals the
    full pass; ``tests/test_ops.py``), and the products stay cache-sized instead of ``[B, T, H, 32, D]``.
    ``stats=False``: no softmax statistics (``None``), for forwards no backward follows."""
    B, T, Hq, D = q.shape
    S = k.shape[1]
    C = KEY_CHUNK
    if B == 0 or T == 0:
        z = q.new_zeros((B, T, k.shape[2], Hq // max(1, k.shape[2])))
        return q.new_zeros(q.shape), z, z
    n_chunks = max(1, -(-S // C))
    outs, ms, dens = [], [], []
    for t0 in range(0, T, C):
        qs, ps = q[:, t0:t0 + C], q_pos[:, t0:t0 + C]
        n = min(n_chunks, max(0, int(ps.max())) // C + 1)
        ks, vs = k[:, :n * C], v[:, :n * C]
        rows = max(1, ATTN_TILE_ELEMENTS // (qs.shape[1] * Hq * C * D))
        parts = [_attention_block(qs[b:b + rows], ks[b:b + rows], vs[b:b + rows], ps[b:b + rows], scale, stats)
                 for b in range(0, B, rows)]
        for acc, i in ((outs, 0), (ms, 1), (dens, 2)) if stats else ((outs, 0),):
            acc.append(parts[0][i] if len(parts) == 1 else torch.cat([x[i] for x in parts]))

    def joined(parts: list[Tensor]) -> Tensor | None:
        return None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts, 1)

    return joined(outs), joined(ms), joined(dens)


def _attention_bwd(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, out: Tensor, m: Tensor, den: Tensor,
                   dout: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Standard attention backward (batched GEMMs): ``P`` is recomputed from ``q``, ``k`` and the
    forward's statistics; ``dS = P * (dP - rowsum(dO * O))``. Correct, not batch-invariant."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv

    def heads(t: Tensor) -> Tensor:  # [B, T, Hq, D] -> [B, Hkv, G*T, D]
        return t.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)

    qh, oh, doh = heads(q), heads(out), heads(dout)
    kh, vh = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)  # [B, Hkv, S, D]
    lse = (m + den.log()).permute(0, 2, 3, 1).reshape(B, Hkv, G * T, 1)
    s = torch.matmul(qh, kh.transpose(-1, -2)).mul_(scale)  # [B, Hkv, G*T, S]
    visible = torch.arange(S, device=q.device)[None, None, :] <= q_pos[:, :, None]  # [B, T, S]
    p = torch.exp(s.sub_(lse)).reshape(B, Hkv, G, T, S)
    p = torch.where(visible[:, None, None], p, p.new_zeros(())).reshape(B, Hkv, G * T, S)
    dv = torch.matmul(p.transpose(-1, -2), doh)  # [B, Hkv, S, D]
    dp = torch.matmul(doh, vh.transpose(-1, -2))
    delta = (doh * oh).sum(-1, keepdim=True)
    ds = p.mul_(dp.sub_(delta)).mul_(scale)
    dq = torch.matmul(ds, kh).reshape(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)
    dk = torch.matmul(ds.transpose(-1, -2), qh).permute(0, 2, 1, 3)  # [B, S, Hkv, D]
    return dq, dk, dv.permute(0, 2, 1, 3)


class _Attention(torch.autograd.Function):
    """Forward: :func:`_attention_fwd` (the invariant bits); backward: :func:`_attention_bwd`.
    Autograd through the forward's materialised per-chunk products costs several times the forward."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float) -> Tensor:
        out, m, den = _attention_fwd(q, k, v, q_pos, scale)
        ctx.save_for_backward(q, k, v, q_pos, out, m, den)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, q_pos, out, m, den = ctx.saved_tensors
        dq, dk, dv = _attention_bwd(q, k, v, q_pos, out, m, den, dout.contiguous(), ctx.scale)
        return dq, dk, dv, None, None


def _attention_rows(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float) -> Tensor:
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, q_pos, scale)
    return _attention_fwd(q, k, v, q_pos, scale, stats=False)[0]


def attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float) -> Tensor:
    """One sequence: ``q [T, Hq, D]``, ``k, v [S, Hkv, D]`` (keys 0..S-1 = the sequence's tokens from
    its start), ``q_pos [T]``; query ``i`` sees keys ``j <= q_pos[i]``; GQA by head grouping."""
    return _attention_rows(q[None], k[None], v[None], q_pos[None].to(torch.long), scale)[0]


def attention_rows(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float,
                   key_start: Tensor | None = None) -> Tensor:
    """A batch of sequences, one per row: ``q [B, T, Hq, D]``, ``k, v [B, S, Hkv, D]``, ``q_pos [B, T]``
    (positions within each sequence). ``key_start [B]``: the column where row ``b``'s sequence starts
    (left padding); keys are realigned so chunk 0 starts there. Same bits as :func:`attention` per row."""
    if key_start is not None and bool((key_start != 0).any()):
        B, S = k.shape[:2]
        j = torch.arange(S, device=k.device)[None, :] + key_start[:, None].to(torch.long)  # [B, S]
        inside = j < S
        idx = j.clamp(max=S - 1)[:, :, None, None].expand(-1, -1, *k.shape[2:])
        k = torch.where(inside[:, :, None, None], torch.gather(k, 1, idx), k.new_zeros(()))
        v = torch.where(inside[:, :, None, None], torch.gather(v, 1, idx), v.new_zeros(()))
    return _attention_rows(q, k, v, q_pos.to(torch.long), scale)


def _gather_rows(t: Tensor, starts: Tensor, lens: Tensor, j: Tensor) -> tuple[Tensor, Tensor]:
    """``t [N, H, D]`` -> ``[len(starts), len(j), H, D]``: position ``j`` of each sequence, zero past its end."""
    valid = j[None, :] < lens[:, None]
    idx = torch.where(valid, starts[:, None] + j[None, :], torch.zeros((), dtype=torch.long, device=t.device))
    g = t[idx.reshape(-1)].reshape(len(starts), j.numel(), *t.shape[1:])
    return torch.where(valid[:, :, None, None], g, g.new_zeros(())), valid


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    """Packed sequences ``q [N, Hq, D]``, ``k, v [N, Hkv, D]`` with boundaries ``cu_seqlens [S+1]``
    (covering all N tokens), causal within each: the same bits as :func:`attention` on each sequence
    alone. Run per query block of :data:`KEY_CHUNK` positions, over only the sequences that reach it
    (with their keys so far), so no row is padded to the longest sequence."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    n_seq, n = len(lens), q.shape[0]
    if n_seq == 0 or n == 0:
        return q.new_zeros(q.shape)
    C = KEY_CHUNK
    dev = q.device
    starts_all = torch.tensor(cu[:-1], dtype=torch.long, device=dev)
    lens_all = torch.tensor(lens, dtype=torch.long, device=dev)
    vals, where = [], []
    for blk in range(-(-max(lens) // C)):
        keep = [i for i, ln in enumerate(lens) if ln > blk * C]
        end = min((blk + 1) * C, max(lens[i] for i in keep))
        sel = torch.tensor(keep, dtype=torch.long, device=dev)
        starts, ln = starts_all[sel], lens_all[sel]
        jq = torch.arange(blk * C, end, device=dev)
        jk = torch.arange(end, device=dev)

        qb, valid_q = _gather_rows(q, starts, ln, jq)
        kb, _ = _gather_rows(k, starts, ln, jk)
        vb, _ = _gather_rows(v, starts, ln, jk)
        out = _attention_rows(qb, kb, vb, jq[None, :].expand(len(sel), -1), scale)  # [sel, T, Hq, D]
        vals.append(out[valid_q])
        where.append((starts[:, None] + jq[None, :])[valid_q])
    order = torch.argsort(torch.cat(where))
    return torch.cat(vals)[order]  # sequence order, then position: the packed order


def selected_logprobs(logits: Tensor, tokens: Tensor, processing: LogprobProcessing | None = None) -> Tensor:
    """fp32 log-prob of ``tokens[i]`` under ``logits [N, V]``: raw (``log_softmax(logits)``, ``processing``
    None) or processed (temperature, then top-k, then top-p, then ``log_softmax``: vLLM's order,
    ``processed_logprobs``). What the actor's replay and every engine report for a sampled token.

    The implementation is core's (:func:`unirl.api.selected_logprobs`): the actor computes processed
    log-probs with or without parity, so core owns the formula, and this module hands the same function
    (and :func:`apply_top_k_top_p`, its mask) to the vLLM side."""
    return _core_selected_logprobs(logits, tokens, processing)


__all__ = [
    "ATTN_ROWS", "KEY_CHUNK", "ROW_BLOCK", "LogprobProcessing", "apply_top_k_top_p", "attention", "attention_rows", "lanewise", "linear", "rms_norm", "rope",
    "rope_cos_sin", "selected_logprobs", "silu_and_mul", "silu_mul", "varlen_attention",
]
