"""The fast decoder: an incremental forward over a Qwen3 / Qwen2 / Llama-shaped model's own modules.

It is written directly over the transformers modules (same RMSNorm, projections, RoPE and MLP
modules, so the weights are the model's own parameters), with a preallocated static KV cache,
boolean masks for left padding and the final norm + lm_head applied to the last position only. It
skips ``generate``'s and the model forward's per-step bookkeeping, which dominates at small sizes; for
the same reason it computes fp32 RMSNorm as one fused call and RoPE on q and k at once, both the
modules' exact bits (:func:`_rms_norm`, :func:`_rope_qk`), runs q/k/v and gate/up as one GEMM each
(:func:`fuse_projections`), and lets the engine prefill the rows of a group once
(:attr:`FastDecoder.shares_prefill`). These two can change a logit in its last bit, since a GEMM's
bits depend on its shape here.

**Parity** (``module_attention``): the decoder keeps its static cache and last-position head, but its
attention then goes through each layer's own ``self_attn`` module (over :class:`_StaticCache`, with
the boolean mask transformers would pass), so the parity provider's attention runs instead of the
private kernels here. Norms, MLPs and projections are module calls then too; nothing is fused and no
prefill is shared.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

_FAST_MODEL_TYPES = ("qwen3", "qwen2", "llama")

#: columns the whole-cache decode grows its KV cache by (see :attr:`FastDecoder.whole_cache`)
CACHE_BLOCK = 128


class _StaticCache:
    """The slice of transformers' ``Cache`` interface an attention module uses (``update``,
    ``get_seq_length``), over the fast path's preallocated, zero-filled K/V, **left-aligned**: row b's
    key for position j sits at column j, whatever the row's left padding. So a provider's attention
    needs no per-step realignment (the mask it gets is plain causal over positions). ``update`` writes
    this call's keys (the prefill shifted left by each row's padding; a decode step at each row's own
    position) and returns the keys and values of columns ``[0, width)``: ``end`` rounded up to whole
    blocks of the parity provider's ``key_block`` (the columns past ``end`` are zeros and masked; see
    :func:`_key_width`)."""

    def __init__(self, kv: list, pos, end: int, pad=None, *, block: int = 1) -> None:
        self.kv, self.pos, self.end, self.pad = kv, pos, end, pad
        self.width = _key_width(end, kv[0][0].shape[2], block)

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs=None):
        import torch

        K, V = self.kv[layer_idx]
        B, H, T, D = key_states.shape
        if self.pad is not None:  # prefill: column j <- input column j + pad (zeros past the prompt)
            j = torch.arange(T, device=key_states.device)
            src = (j[None, :] + self.pad[:, None]).clamp(max=T - 1)
            keep = (j[None, :] + self.pad[:, None] < T)[:, None, :, None]
            idx = src[:, None, :, None].expand(B, H, T, D)
            K[:, :, :T] = key_states.gather(2, idx) * keep
            V[:, :, :T] = value_states.gather(2, idx) * keep
        else:  # decode: each row's token at its own position (one index_copy_ into the flat cache)
            S = K.shape[2]
            bh = torch.arange(B * H, device=key_states.device).view(B, H)
            idx = (bh * S + self.pos[:, :1]).reshape(-1)
            K.view(-1, D).index_copy_(0, idx, key_states[:, :, 0].reshape(-1, D))
            V.view(-1, D).index_copy_(0, idx, value_states[:, :, 0].reshape(-1, D))
        return K[:, :, : self.width], V[:, :, : self.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.end - 1


def _whole_key_blocks(n: int, block: int) -> int:
    """``n`` rounded up to a whole number of ``block`` s."""
    return -(-n // block) * block


def _key_width(end: int, allocated: int, block: int) -> int:
    """Columns of a cache in whole ``block`` s that holds keys ``[0, end)``: ``end`` rounded up to whole
    blocks, at most ``allocated``. What a module attention sees of the static cache, and the width of
    the whole-cache decode's growing cache."""
    return min(allocated, _whole_key_blocks(end, block))


def _position_mask(pos, end: int):
    """``[B, 1, T, end]`` bool: query at position p sees the left-aligned keys 0..p (of ``end`` columns)."""
    import torch

    return torch.arange(end, device=pos.device)[None, None, None, :] <= pos[:, None, :, None]


def _rms_norm(norm, x):
    """transformers' RMSNorm (Qwen3 / Qwen2 / Llama) as one fused ATen call, with the module's bits
    (``tests/test_torch_engine.py`` checks widths 16..4,096, 1..333 rows, 1 and 2 threads, fp32 and bf16)
    in a fraction of its dispatches: a decode step at small sizes is mostly dispatch. In fp32 the fused
    op takes the weight. In bf16 it may not: the fused op applies the weight before rounding to bf16,
    the module after. So there the fused op normalises in fp32 without the weight, and the weight
    multiplies the rounded result, as in the module (8 dispatches a norm become 4)."""
    import torch.nn.functional as F

    if x.dtype != norm.weight.dtype:
        return norm(x)
    if x.dtype.itemsize == 4:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return _unweighted_norm(x, norm.variance_epsilon) * norm.weight


def _unweighted_norm(x, eps: float):
    """RMSNorm of ``x`` over its last dim, computed in fp32 and rounded back to ``x``'s dtype, without a
    weight: the weighted norms here multiply their weight into this rounded result (the module's order)."""
    import torch.nn.functional as F

    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _rope(x, cos, sin):
    """transformers' ``apply_rotary_pos_emb`` (``x * cos + rotate_half(x) * sin``) on ``x [B, H, T, D]``,
    the heads of q and k together: the same elementwise operations on every element, so the same bits,
    in half the dispatches."""
    import torch

    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, None]


def _rope_qk(q, k, cos, sin):
    """:func:`_rope` on q and k, concatenated over heads and split back."""
    import torch

    out = _rope(torch.cat((q, k), 1), cos, sin)
    return out[:, : q.shape[1]], out[:, q.shape[1] :]


def _qk_norm(q_norm, k_norm, qk, n_q: int):
    """Qwen3's ``q_norm`` and ``k_norm`` on ``qk [B, T, Hq + Hkv, D]`` (q's heads first) in one fused
    RMSNorm. The fused op applies the weight as its last, separate multiply, so normalising without it
    and multiplying by the two weights stacked per head gives each norm's bits (checked in
    ``tests/test_torch_engine.py``); in bf16 the normalising runs in fp32 and the weights multiply the
    rounded result, as :func:`_rms_norm` says. With different epsilons it is two calls."""
    import torch

    if q_norm.variance_epsilon != k_norm.variance_epsilon or qk.dtype != q_norm.weight.dtype:
        return torch.cat((_rms_norm(q_norm, qk[:, :, :n_q]), _rms_norm(k_norm, qk[:, :, n_q:])), 2)
    w = torch.cat((q_norm.weight.expand(n_q, -1), k_norm.weight.expand(qk.shape[2] - n_q, -1)))
    return _unweighted_norm(qk, q_norm.variance_epsilon) * w


def supports(model: Any) -> bool:
    """Whether ``model`` has the shape :class:`FastDecoder` restates: a known decoder type, full sdpa or
    eager attention, and the modules (and RMSNorm fields) it calls by name. Anything else uses the
    model's own forward (:class:`~unirl.engine.decoder.HFDecoder`)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in _FAST_MODEL_TYPES:
        return False
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager", None):
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return False
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, n) for n in needed) or not hasattr(model, "lm_head"):
        return False
    for layer in inner.layers:
        a = getattr(layer, "self_attn", None)
        if a is None or not all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
            return False
        if not all(hasattr(layer, n) for n in ("mlp", "input_layernorm", "post_attention_layernorm")):
            return False
        if getattr(a, "sliding_window", None):
            return False
        norms = [layer.input_layernorm, layer.post_attention_layernorm, *(
            [a.q_norm, a.k_norm] if hasattr(a, "q_norm") else [])]
        if not all(hasattr(n, "variance_epsilon") and hasattr(n, "weight") for n in norms):
            return False  # _rms_norm restates transformers' RMSNorm (weight, variance_epsilon)
    rope = getattr(sys.modules[type(inner.layers[0].self_attn).__module__], "apply_rotary_pos_emb", None)
    return rope is not None


def fuse_projections(model: Any) -> list[tuple[Any, Any]]:
    """Put each layer's q / k / v weights, and its MLP's gate / up weights, into one tensor each,
    with the parameters left as views of it. A decode step then runs one GEMM where it ran three
    (and one for two): at decode sizes each call costs more in dispatch than in arithmetic.
    ``load_weights`` copies into the parameters, so the fused tensors always hold the served weights.
    A layer with biases, or an MLP that is not ``down(act(gate(x)) * up(x))``, keeps its modules."""
    import torch

    def fuse(mods) -> Any:
        if any(getattr(m, "bias", None) is not None for m in mods):
            return None
        fused = torch.cat([m.weight.detach() for m in mods])
        at = 0
        for m in mods:
            n = m.weight.shape[0]
            m.weight.data = fused[at : at + n]
            at += n
        return fused

    out = []
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        qkv = fuse((a.q_proj, a.k_proj, a.v_proj))
        glu = all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        out.append((qkv, fuse((mlp.gate_proj, mlp.up_proj)) if glu else None))
    return out


class FastDecoder:
    """The :class:`~unirl.engine.decoder.Decoder` over a static KV cache (see the module doc).

    ``module_attention``: a parity provider's ops live in the modules, so attention goes through each
    layer's ``self_attn`` over a left-aligned, zero-filled cache allocated in whole ``key_block`` s (the
    provider's key chunk: its attention reads the cache in place in whole blocks)."""

    def __init__(self, model: Any, dtype: torch.dtype, *, module_attention: bool = False, key_block: int = 1):
        self.model, self.dtype = model, dtype
        self.module_attention, self.key_block = module_attention, key_block
        #: rows with equal contexts may prefill once (the engine fans the state out); never under parity
        self.shares_prefill = not module_attention
        #: two batches' states may be joined mid-decode (:meth:`merge`, continuous batching); not under parity,
        #: whose left-aligned cache a provider's attention reads in place
        self.merges_rows = not module_attention
        #: per layer, the fused q|k|v and gate|up weights (None: the layer's modules)
        self.fused: list[tuple[Any, Any]] = [] if module_attention else fuse_projections(model)
        #: a decode step attends over the whole zero-filled cache (the columns past the step masked) instead
        #: of its first ``end`` columns. In bf16 a slice of the cache is not contiguous, and the CPU's bf16
        #: batched matmul copies it and then runs a slower kernel: over 1,055 of 1,056 columns (64 rows, 4 KV
        #: heads, head dim 64) the slice took 31 ms, the whole cache 3.6. Early in a decode the whole cache
        #: does more work than the slice, but over whole decodes it won: 0.95x the slice's step time at 64
        #: tokens, 0.57x at 512 (25 M). In fp32 the slice is not copied and the whole cache lost (1.21x at
        #: 512), so fp32 keeps the slice (AMD EPYC, 2 threads; ``benchmarks/decode_attention.py``). It is the
        #: CPU kernel's behaviour, not bf16's: on another device the slice stays.
        #: The "whole" cache is allocated in whole :data:`CACHE_BLOCK` s and grown a block at a time (one copy
        #: per block, :meth:`_grow`), so a decode step reads the blocks written so far, not the cache of the
        #: longest response: 1,088 columns from the first step of a 1,024-token decode read about twice the
        #: keys the steps need (the ``bmm`` was 39 % of the 100 M x 1024 rollout).
        on_cpu = next(model.parameters()).device.type == "cpu"
        self.whole_cache = not module_attention and dtype.itemsize < 4 and on_cpu

    def prefill(self, ids, pos, valid, max_new: int) -> dict[str, Any]:
        import torch

        m, inner = self.model, self.model.model
        B, P = ids.shape
        cfg = m.config
        a0 = inner.layers[0].self_attn
        head_dim = a0.head_dim if hasattr(a0, "head_dim") else cfg.hidden_size // cfg.num_attention_heads
        # module attention's left-aligned cache (see _StaticCache) and the whole-cache decode read zeros past
        # each row's keys: a masked column weighs 0, but 0 x NaN from uninitialised memory would not
        alloc = torch.zeros if self.module_attention or self.whole_cache else torch.empty
        cols = P + max_new
        if self.module_attention:  # whole key blocks (see _StaticCache): the attention reads it in place
            cols = _whole_key_blocks(cols, self.key_block)
        elif self.whole_cache:  # the blocks the prompt fills; decode steps grow it (_grow)
            cols = _key_width(P, cols, CACHE_BLOCK)
        shape = (B, cfg.num_key_value_heads, cols, head_dim)
        kv = [(alloc(shape, dtype=self.dtype, device=ids.device), alloc(shape, dtype=self.dtype, device=ids.device))
              for _ in inner.layers]
        if self.module_attention:
            state = {"kv": kv, "valid": valid, "pad": P - valid[:, :P].sum(-1)}
            state["logits"] = self.forward(state, ids, pos, 0, None)
            del state["pad"]
            return state
        causal = torch.ones((P, P), dtype=torch.bool, device=ids.device).tril()
        eye = torch.eye(P, dtype=torch.bool, device=ids.device)
        # pad queries attend to themselves only: no all-masked rows (NaN) anywhere in the cache
        mask = (causal[None] & valid[:, None, :P]) | eye[None]
        state = {"kv": kv, "valid": valid}
        state["logits"] = self.forward(state, ids, pos, 0, mask[:, None])
        return state

    def step(self, state, tok, pos, start: int):
        import torch

        if self.module_attention:
            return self.forward(state, tok, pos, start, None)
        if "bias" not in state:  # additive mask over the cache for the decode attention
            bias = torch.zeros(state["valid"].shape, dtype=self.dtype, device=state["valid"].device)
            state["bias"] = bias.masked_fill(~state["valid"], -math.inf)[:, None, None, :]
        bias = state["bias"]
        if self.whole_cache:  # the columns after this step's are zeros: masked, they weigh exactly 0
            width = self._grow(state, start + 1)
            if "columns" not in state:
                state["columns"] = torch.arange(bias.shape[-1], device=bias.device)
            mask = bias[..., :width].masked_fill(state["columns"][:width] > start, -math.inf)
            return self.forward(state, tok, pos, start, mask)
        return self.forward(state, tok, pos, start, bias[..., : start + 1])

    @staticmethod
    def _grow(state: dict[str, Any], end: int) -> int:
        """The whole cache's width once it holds keys ``[0, end)``: a block wider (at most the allocation
        the decode asked for, ``valid``'s width) when ``end`` outgrew it, the written columns copied over
        and the new ones zeros (masked, they weigh exactly 0)."""
        import torch

        width = state["kv"][0][0].shape[2]
        if end <= width:
            return width
        grown = _key_width(end, state["valid"].shape[1], CACHE_BLOCK)
        for i, (K, V) in enumerate(state["kv"]):
            new = [torch.zeros((*X.shape[:2], grown, X.shape[3]), dtype=X.dtype, device=X.device) for X in (K, V)]
            new[0][:, :, :width], new[1][:, :, :width] = K, V
            state["kv"][i] = (new[0], new[1])
        return grown

    @staticmethod
    def select(state: dict[str, Any], keep: torch.Tensor) -> dict[str, Any]:
        state["valid"] = state["valid"][keep]
        if "bias" in state:
            state["bias"] = state["bias"][keep]
        state["kv"] = [(K[keep], V[keep]) for K, V in state["kv"]]
        return state

    def merge(self, a: dict[str, Any], ca: int, b: dict[str, Any], cb: int, need: int) -> tuple[dict[str, Any], int]:
        """Join ``b``'s rows after ``a``'s: ``a`` and ``b`` have their next cache column at ``ca`` and ``cb``
        (keys ``[0, c)`` written). Both are right-aligned on the common column ``c = max(ca, cb)``: a row's
        keys keep their positions (RoPE reads ``pos``, not the column) and the columns shifted in on the
        left are zeros marked invalid (masked, they weigh exactly 0). Columns no row uses on the left are
        trimmed, so a stream of merges keeps the cache as wide as its longest live row. ``need``: the
        columns after ``c`` the rows may still write. Returns the state and its next column."""
        import torch

        c = max(ca, cb)
        parts = ((a, ca, c - ca), (b, cb, c - cb))
        lo = min(off + int(s["valid"][:, :n].any(0).int().argmax()) for s, n, off in parts)
        c -= lo
        rows_ = [s["valid"].shape[0] for s, _, _ in parts]
        width = c + need
        valid = torch.zeros((sum(rows_), width), dtype=torch.bool, device=a["valid"].device)
        valid[:, c:] = True
        cols = _key_width(c, width, CACHE_BLOCK) if self.whole_cache else width
        K0 = a["kv"][0][0]
        kv = [tuple(torch.zeros((sum(rows_), K0.shape[1], cols, K0.shape[3]), dtype=K0.dtype, device=K0.device)
                    for _ in range(2)) for _ in a["kv"]]
        r0 = 0
        for (s, n, off), nr in zip(parts, rows_, strict=True):
            dst, src = off - lo, 0
            if dst < 0:  # this batch's leftmost columns are padding in every row: trimmed
                dst, src = 0, -dst
            span = n - src
            valid[r0 : r0 + nr, dst : dst + span] = s["valid"][:, src:n]
            for (K, V), (Ks, Vs) in zip(kv, s["kv"], strict=True):
                K[r0 : r0 + nr, :, dst : dst + span] = Ks[:, :, src:n]
                V[r0 : r0 + nr, :, dst : dst + span] = Vs[:, :, src:n]
            r0 += nr
        return {"kv": kv, "valid": valid}, c

    def forward(self, state, ids, pos, start: int, mask):
        """``mask``: the hand-written attention's mask; under module attention ``None`` (the mask follows
        from the static cache's width, which only the cache knows)."""
        import torch
        import torch.nn.functional as F

        m, inner = self.model, self.model.model
        B, T = ids.shape
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, pos)
        end = start + T
        cache = _StaticCache(state["kv"], pos, end, state.get("pad"), block=self.key_block) if self.module_attention else None
        if cache is not None:  # module attention: plain causal over the positions, as wide as the cache reads
            mask = _position_mask(pos, cache.width)
        for i, (layer, (K, V)) in enumerate(zip(inner.layers, state["kv"], strict=True)):
            a = layer.self_attn
            if cache is not None:
                x = layer.input_layernorm(h)
                o = a(x, position_embeddings=(cos, sin), attention_mask=mask, past_key_values=cache,
                      position_ids=pos)[0]
                h = h + o
                h = h + layer.mlp(layer.post_attention_layernorm(h))
                continue
            x = _rms_norm(layer.input_layernorm, h)
            shape = (B, T, -1, K.shape[-1])
            qkv_w, glu_w = self.fused[i]
            if qkv_w is not None:  # q, k and v heads side by side: q and k are normed and rotated together
                n_q, n_kv = a.q_proj.weight.shape[0] // K.shape[-1], K.shape[1]
                heads = F.linear(x, qkv_w).view(shape)
                qk, v = heads[:, :, : n_q + n_kv], heads[:, :, n_q + n_kv :].transpose(1, 2)
                if hasattr(a, "q_norm"):
                    qk = _qk_norm(a.q_norm, a.k_norm, qk, n_q)
                qk = _rope(qk.transpose(1, 2), cos, sin)
                q, k = qk[:, :n_q], qk[:, n_q:]
            else:
                q, k, v = a.q_proj(x).view(shape), a.k_proj(x).view(shape), a.v_proj(x).view(shape)
                if hasattr(a, "q_norm"):
                    q, k = _rms_norm(a.q_norm, q), _rms_norm(a.k_norm, k)
                v = v.transpose(1, 2)
                q, k = _rope_qk(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            K[:, :, start:end] = k
            V[:, :, start:end] = v
            if T == 1:  # decode: grouped-query matmul attention, cheaper than sdpa's kernels at q_len 1
                Hkv, keys = K.shape[1], K.shape[2] if self.whole_cache else end
                qg = q.reshape(B, Hkv, -1, K.shape[-1])  # heads of one kv group are contiguous
                scores = torch.matmul(qg, K[:, :, :keys].transpose(-1, -2)) * a.scaling + mask
                w = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qg.dtype)
                o = torch.matmul(w, V[:, :, :keys]).reshape(B, -1, 1, K.shape[-1])
            else:
                o = F.scaled_dot_product_attention(
                    q, K[:, :, :end], V[:, :, :end], attn_mask=mask, scale=a.scaling,
                    enable_gqa=q.shape[1] != K.shape[1],
                )
            h = h + a.o_proj(o.transpose(1, 2).reshape(B, T, -1))
            x = _rms_norm(layer.post_attention_layernorm, h)
            if glu_w is not None:
                mlp = layer.mlp
                gate, up = F.linear(x, glu_w).chunk(2, -1)
                h = h + mlp.down_proj(mlp.act_fn(gate) * up)
            else:
                h = h + layer.mlp(x)
        norm = inner.norm(h[:, -1]) if cache is not None else _rms_norm(inner.norm, h[:, -1])
        return m.lm_head(norm)
