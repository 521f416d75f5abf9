"""The replacements installed into vLLM: each routes one vLLM op through :mod:`unirl_parity_vllm.ops`.

Every function here has exactly the signature of the vLLM symbol it replaces (checked by the
preflight in :mod:`unirl_parity_vllm.vllm_side.symbols`), and does nothing clever: it adapts vLLM's
calling convention (views, the paged KV cache, the fused residual add) to the reference op, so the
numbers come from the same code the trainer runs.

Replaced (vLLM 0.32.0, CPU platform):

* ``layers/utils.py:dispatch_cpu_unquantized_gemm`` -> :func:`dispatch_cpu_unquantized_gemm`: instead
  of packing the weight into a oneDNN / sgl handle, it sets ``layer.cpu_linear`` to
  :class:`ParityLinear`, which calls ``ops.linear(x, weight, bias)`` on the *live* ``layer.weight``
  (kept, not emptied). An in-place weight update therefore needs no re-pack, and vLLM's layerwise
  reload (which re-runs ``process_weights_after_loading``) re-dispatches through this function;
* ``layers/logits_processor.py:LogitsProcessor._apply_head`` -> :func:`logits_apply_head`: logits
  ``ops.linear(h, lm_head.weight, bias)`` in the activations' dtype (fp32, or bf16 as the trainer's
  bf16 compute gives them) on the live (possibly tied) head weight;
* ``layers/layernorm.py:RMSNorm.forward_cpu`` / ``forward_native`` -> :func:`rms_norm_forward`
  (the fused residual form adds first, ``residual = x + residual``, then normalises);
* ``layers/activation.py:SiluAndMul.forward_cpu`` / ``forward_native`` -> ``ops.silu_and_mul``;
* ``layers/rotary_embedding/base.py:RotaryEmbedding.forward_cpu`` / ``forward_native`` ->
  :func:`rope_forward` (neox, full rotary dimension; the cos/sin tables are ``ops.rope_cos_sin``,
  the trainer's, computed with vLLM's formula);
* ``v1/attention/backends/cpu_attn.py:CPUAttentionBackendImpl.do_kv_cache_update`` ->
  :func:`kv_cache_update`: writes K **and** V plain, ``[block, kv_head, offset, D]``, into the two
  halves of each block (vLLM's own writer stores K in an ISA-specific transposed layout; this plugin
  owns both the writer and the reader, so it never depends on that layout);
* ``CPUAttentionBackendImpl.forward`` -> :func:`attention_forward`: per sequence, gathers its keys and
  values from the paged cache through the block table (``seq_lens``, ``query_start_loc`` from the
  metadata) and calls ``ops.attention(q, k, v, q_pos, scale)`` with ``q_pos`` the absolute positions
  (decode rows, one new token each, go together through ``ops.attention_rows``: same bits per row);
* ``v1/sample/sampler.py:Sampler.compute_logprobs`` -> :func:`compute_logprobs`: the fp32
  log-softmax the trainer's ``ops.selected_logprobs`` gathers from;
* ``v1/sample/ops/topk_topp_sampler.py:apply_top_k_top_p`` -> :func:`apply_top_k_top_p`: the top-k /
  top-p mask of ``processed_logprobs`` (and of the draw) is ``ops.apply_top_k_top_p``, core's
  :mod:`unirl.logprobs`, the one the trainer's replay applies (vLLM's own dispatches on Triton's presence).

CUDA platform (``plugins.parity.platform: cuda``; written from vLLM 0.32.0's source, signature-checked
here, **never run on a GPU**): ``UnquantizedLinearMethod.apply`` -> :func:`unquantized_linear_apply`;
``forward_cuda`` of RMSNorm / SiluAndMul / RotaryEmbedding -> the same functions as ``forward_cpu``;
``FlashAttentionImpl.do_kv_cache_update`` / ``forward`` -> :func:`flash_kv_cache_update` /
:func:`flash_attention_forward` (the flash cache layout, :func:`flash_cache_views`); logits and sampler
targets shared (``symbols.CUDA``).
"""

from __future__ import annotations

from typing import Any

import torch

from unirl.api import UniRLError
from unirl_parity_vllm import ops


class ParityKernelError(UniRLError):
    """A patched vLLM op met a configuration it cannot compute exactly (it refuses, never guesses)."""


def _refuse(what: str, why: str) -> None:
    raise ParityKernelError(f"unirl-parity-vllm: {what}: {why}; parity cannot be exact, refusing to serve")


# ------------------------------------------------------------------------------------------ linear
class ParityLinear:
    """``layer.cpu_linear`` under parity: ``ops.linear`` on the weight vLLM passes at call time.

    vLLM calls ``layer.cpu_linear(x, layer.weight, bias)`` (``cpu_unquantized_gemm``); the weight is the
    live parameter, so a reload that copies new values into it is served at once.

    **Tensor parallelism.** A column-parallel layer (q/k/v, gate/up, the vocab-parallel head) holds whole
    output columns: ``ops.linear`` gives every column the bits it has in the unsharded matmul, so it
    needs nothing. A **row-parallel** layer (o_proj, down_proj) holds a slice of the *contraction*
    dimension: each rank would sum half of every dot product and vLLM's all-reduce would add the halves,
    a reduction order the trainer's unsharded forward never uses (the TP1 and TP2 log-probs differ in
    the last digit). So a row-parallel ``ParityLinear`` (``row_parallel=True``, set by
    :func:`dispatch_cpu_unquantized_gemm` when ``tp_size > 1``) is **shard-invariant**: it all-gathers
    the input slices and the weight slices (exact copies), rank 0 computes the full unsharded
    ``ops.linear`` in the reference order, and every other rank returns ``-0.0``, the exact additive
    identity (``a + -0.0 == a`` bit for bit, signed zeros included), so vLLM's all-reduce that follows
    reproduces rank 0's result on every rank. The trainer side needs no change. Cost: one all-gather of
    the input per call, and of the weight once per weight version when the profile's ``tp_gather_cache``
    is on (:func:`unirl_parity_vllm.vllm_side.settings.tp_gather_cache`), else per call.

    **The gathered weight is cached per weight version** without any version bookkeeping: vLLM builds
    a new ``ParityLinear`` every time the layer's weights are (re)loaded (a weight sync's layerwise reload
    re-runs ``process_weights_after_loading``, hence :func:`dispatch_cpu_unquantized_gemm`), so the cache
    dies with the version it was gathered from. Rank 0 only keeps it (the other ranks compute nothing)."""

    __slots__ = ("name", "row_parallel", "reduces", "cache", "gathered", "full_weight")

    def __init__(self, name: str = "", row_parallel: bool = False, reduces: bool = True,
                 cache: bool = False) -> None:
        self.name = name
        self.row_parallel = row_parallel
        self.reduces = reduces
        self.cache = cache
        self.gathered = False  # this version's weight was gathered (on every rank; rank 0 keeps it)
        self.full_weight: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.ndim != 2 or weight.numel() == 0:
            _refuse(f"linear {self.name}", f"weight of shape {tuple(weight.shape)} (emptied by another packer?)")
        if not self.row_parallel:
            return ops.linear(x, weight, bias)
        if not self.reduces:
            _refuse(f"linear {self.name}", "a row-parallel layer with reduce_results=False (its caller sums the "
                    "partial products in an order the trainer does not reproduce)")
        return _row_parallel_linear(x, weight, bias, self)

    def __repr__(self) -> str:
        return f"ParityLinear({self.name!r})"


#: the original ``dispatch_cpu_unquantized_gemm`` (set by the installer; used for non-linear weights)
ORIGINAL_GEMM_DISPATCH: Any = None
#: how many layers were dispatched through :func:`dispatch_cpu_unquantized_gemm` in this process
GEMM_DISPATCHES = {"linear": 0, "delegated": 0, "row_parallel": 0}


def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Parity GEMM dispatch: ``layer.cpu_linear = ParityLinear()``; the weight is kept (never packed).

    Meta weights (missing layers) and non-2-D weights (conv / MoE experts, not linears) go to vLLM's
    own dispatch unchanged, as before."""
    weight = getattr(layer, "weight", None)
    if weight is None or weight.is_meta or weight.ndim != 2:
        GEMM_DISPATCHES["delegated"] += 1
        return ORIGINAL_GEMM_DISPATCH(layer, remove_weight)
    row_parallel = _is_row_parallel(layer)
    from unirl_parity_vllm.vllm_side.settings import tp_gather_cache

    layer.cpu_linear = ParityLinear(type(layer).__name__, row_parallel=row_parallel,
                                    reduces=bool(getattr(layer, "reduce_results", True)),
                                    cache=row_parallel and tp_gather_cache())
    GEMM_DISPATCHES["linear"] += 1
    if row_parallel:
        GEMM_DISPATCHES["row_parallel"] += 1
    return None


def _is_row_parallel(layer: torch.nn.Module) -> bool:
    """A ``RowParallelLinear`` split over more than one TP rank (its contraction dim is sharded)."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    return isinstance(layer, RowParallelLinear) and int(getattr(layer, "tp_size", 1)) > 1


def _row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         linear: ParityLinear) -> torch.Tensor:
    """The unsharded ``ops.linear`` on rank 0, ``-0.0`` elsewhere (see :class:`ParityLinear`).

    ``x`` is ``[..., K / tp]`` and ``weight`` ``[N, K / tp]``, each rank holding its slice of K in rank
    order; the all-gathers concatenate them in that order (vLLM's CPU shm all-gather copies bytes). Every
    rank must take part in the same collectives on every call (a rank that skipped one would hang the
    others): the ranks build their ParityLinear in the same reload, so all of them gather on the same
    first call and all of them mark it ``gathered``; only rank 0 keeps the tensor."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    full_x = group.all_gather(x.contiguous(), dim=-1)
    if linear.gathered:
        full_w = linear.full_weight
    else:
        full_w = group.all_gather(weight.contiguous(), dim=1)
        if linear.cache:
            linear.gathered = True
            linear.full_weight = full_w if group.rank_in_group == 0 else None
    if group.rank_in_group == 0:
        return ops.linear(full_x, full_w, bias)
    return torch.full((*x.shape[:-1], weight.shape[0]), -0.0, dtype=x.dtype, device=x.device)


def unquantized_linear_apply(self: Any, layer: torch.nn.Module, x: torch.Tensor,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``UnquantizedLinearMethod.apply`` on CUDA (vLLM 0.32.0; the CPU dispatches through
    :func:`dispatch_cpu_unquantized_gemm` instead): ``ops.linear`` on the live ``layer.weight``, a
    row-parallel layer (TP > 1) shard-invariant as :class:`ParityLinear` explains. Replaces both vLLM's
    GEMM pick (cuBLAS / FlashInfer) and its ``VLLM_BATCH_INVARIANT`` kernel. Never run on a GPU here."""
    row_parallel = _is_row_parallel(layer)
    return ParityLinear(type(layer).__name__, row_parallel=row_parallel,
                        reduces=bool(getattr(layer, "reduce_results", True)))(x, layer.weight, bias)


def logits_apply_head(self: Any, lm_head: Any, hidden_states: torch.Tensor,
                      embedding_bias: torch.Tensor | None) -> torch.Tensor:
    """Logits through ``ops.linear`` on the live head weight (tied: the embedding's), in the
    activations' dtype, as the trainer's patched ``lm_head`` computes them: fp32 for an fp32 model,
    bf16 logits (``ops.linear`` rounds its fp32 accumulation once) for a bf16 one. The sampler takes
    its fp32 log-probs from those logits, like the trainer's ``logits.float()``; fp32 logits here would
    skip that one rounding and differ from the replay on every token (docs/parity.md, bf16)."""
    weight = lm_head.weight
    if weight.ndim != 2 or weight.numel() == 0:
        _refuse("lm_head", f"weight of shape {tuple(weight.shape)}")
    dtype = hidden_states.dtype
    bias = embedding_bias.to(dtype) if embedding_bias is not None else None
    return ops.linear(hidden_states, weight.to(dtype), bias)


# ------------------------------------------------------------------------------------------ norms
def rms_norm_forward(self: Any, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
    """``RMSNorm`` (vLLM) through ``ops.rms_norm``; with ``residual``: ``r = x + residual`` first."""
    if self.variance_size_override is not None:
        _refuse("RMSNorm", "var_hidden_size override (partial-width variance)")
    weight = self.weight.data if isinstance(self.weight, torch.nn.Parameter) else self.weight
    if weight.device != x.device or weight.dtype != x.dtype:
        weight = weight.to(device=x.device, dtype=x.dtype)
    eps = self.variance_epsilon
    if residual is None:
        return ops.rms_norm(x, weight, eps)
    summed = x + residual
    return ops.rms_norm(summed, weight, eps), summed


# ------------------------------------------------------------------------------------------ MLP
def silu_and_mul_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``SiluAndMul.forward_cpu``: gate is the first half, up the second."""
    return ops.silu_and_mul(x)


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """``SiluAndMul.forward_native`` (a staticmethod in vLLM)."""
    return ops.silu_and_mul(x)


# ------------------------------------------------------------------------------------------ RoPE
def rope_forward(self: Any, positions: torch.Tensor, query: torch.Tensor,
                 key: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``RotaryEmbedding`` through ``ops.rope`` (neox style, rotary dim == head size)."""
    if not self.is_neox_style:
        _refuse("RotaryEmbedding", "GPT-J (interleaved) style")
    if self.rotary_dim != self.head_size:
        _refuse("RotaryEmbedding", f"partial rotary ({self.rotary_dim} of {self.head_size})")
    # the trainer's tables (vLLM's formula; cos/sin through ops.lanewise), not vLLM's cache: a plain
    # freqs.cos() takes ATen's scalar tail for some elements and can differ in the last bit
    cos, sin = ops.rope_cos_sin(self.rotary_dim, self.base, self.max_position_embeddings)
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    if positions.dtype != torch.long:
        positions = positions.long()
    q = ops.rope(positions, query.reshape(num_tokens, -1, self.head_size), cos, sin).reshape(query.shape)
    k = None
    if key is not None:
        k = ops.rope(positions, key.reshape(num_tokens, -1, self.head_size), cos, sin).reshape(key.shape)
    return q, k


# ------------------------------------------------------------------------------------------ attention
def _split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
    view = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))
    return view[:, :, :block_size], view[:, :, block_size:], block_size


def _check_attention(self: Any, kv_cache: torch.Tensor, query: torch.Tensor, *, windowed: bool) -> None:
    """Refuse what the reference attention does not cover, on either backend's impl (``windowed``: the
    impl's own way of saying it has a sliding window, the one field the backends spell differently)."""
    from vllm.v1.attention.backend import AttentionType

    if self.attn_type != AttentionType.DECODER:
        _refuse("attention", f"attn_type {self.attn_type!r} (only decoder self-attention)")
    if windowed:
        _refuse("attention", f"sliding window {self.sliding_window}")
    if self.alibi_slopes is not None:
        _refuse("attention", "ALiBi slopes")
    if self.logits_soft_cap not in (0, None):
        _refuse("attention", f"logits soft cap {self.logits_soft_cap}")
    if self.sinks is not None:
        _refuse("attention", "attention sinks")
    if self.kv_cache_dtype != "auto" or kv_cache.dtype != query.dtype:
        _refuse("attention", f"KV cache dtype {self.kv_cache_dtype} / {kv_cache.dtype} (query {query.dtype})")


def _check_impl(self: Any, kv_cache: torch.Tensor, query: torch.Tensor) -> None:
    _check_attention(self, kv_cache, query, windowed=self.sliding_window not in (-1, None))


def kv_cache_update(self: Any, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write this step's K and V into the paged cache, both plain ``[block, kv_head, offset, D]``."""
    from vllm.v1.attention.backend import AttentionType

    if self.attn_type in (AttentionType.ENCODER_ONLY, AttentionType.ENCODER):
        return
    _check_impl(self, kv_cache, key)
    key_cache, value_cache, block_size = _split_cache(kv_cache)
    slots = slot_mapping.flatten().to(torch.long)
    n = slots.shape[0]
    key, value = key[:n], value[:n]
    valid = slots >= 0  # padded tokens carry slot -1
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    key_cache[blocks, :, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value.to(value_cache.dtype)


def gather_sequence_kv(kv_cache: torch.Tensor, block_row: torch.Tensor,
                       seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values from the paged cache: ``[seq_len, kv_heads, D]`` each."""
    k, v = gather_batch_kv(kv_cache, block_row[None], [seq_len])
    return k[0], v[0]


def gather_batch_kv(kv_cache: torch.Tensor, block_rows: torch.Tensor,
                    seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``B`` sequences, ``[B, max(seq_lens), kv_heads, D]``, exact zeros past each
    sequence's end (the cache there may hold anything, even NaN: ``0 * NaN`` would leak through).

    ``index_select`` on the block dimension: advanced indexing of the (non-contiguous) half-block
    view costs milliseconds per call on a large cache."""
    num_blocks, heads, block_size, _ = kv_cache.size()
    dim = kv_cache.shape[3] // 2
    longest = max(seq_lens)
    nblocks = (longest + block_size - 1) // block_size
    ids = block_rows[:, :nblocks].to(torch.long).reshape(-1)
    blocks = kv_cache.index_select(0, ids).view(len(seq_lens), nblocks, heads, 2 * block_size, dim)
    k = blocks[:, :, :, :block_size].permute(0, 1, 3, 2, 4).reshape(len(seq_lens), nblocks * block_size, heads, dim)
    v = blocks[:, :, :, block_size:].permute(0, 1, 3, 2, 4).reshape(len(seq_lens), nblocks * block_size, heads, dim)
    k, v = k[:, :longest], v[:, :longest]
    lens = torch.tensor(seq_lens, dtype=torch.long)
    if bool((lens < longest).any()):
        inside = (torch.arange(longest)[None, :] < lens[:, None])[:, :, None, None]
        zero = k.new_zeros(())
        k, v = torch.where(inside, k, zero), torch.where(inside, v, zero)
    return k, v


#: attention calls in this process: prefill sequences (with cached context: prefix-cache hits or
#: chunked prefill) and decode rows
ATTENTION_CALLS = {"prefill": 0, "prefill_with_context": 0, "decode_rows": 0}

#: called once, at the first real attention call in this process (the installer records the manifest)
ON_FIRST_SERVE: Any = None


def _first_serve() -> None:
    """Run the hook; it stays armed if it raises (every later call refuses too)."""
    global ON_FIRST_SERVE
    ON_FIRST_SERVE()
    ON_FIRST_SERVE = None


def attention_forward(self: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor,
                      output_scale: torch.Tensor | None = None,
                      output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal decoder attention from the paged cache: ``ops.attention`` per prefill sequence, one
    ``ops.attention_rows`` call for all decode rows."""
    if output_scale is not None or output_block_scale is not None:
        _refuse("attention", "fused output quantization")
    if attn_metadata is None:  # warm-up / profiling run
        return output
    _check_impl(self, kv_cache, query)
    if ON_FIRST_SERVE is not None:
        _first_serve()
    if not attn_metadata.causal or attn_metadata.dynamic_causal is not None:
        _refuse("attention", "non-causal or dynamic-causal metadata")
    return _paged_attention(self, query, attn_metadata, output,
                            lambda rows, lens: gather_batch_kv(kv_cache, rows, lens))


def _paged_attention(self: Any, query: torch.Tensor, attn_metadata: Any, output: torch.Tensor, gather: Any) -> torch.Tensor:
    """The attention of every scheduled request from a paged cache (either layout: ``gather(block_rows,
    seq_lens)`` returns ``[B, max(seq_lens), kv_heads, D]`` keys and values, exact zeros past each end):
    ``ops.attention`` per prefill sequence, one ``ops.attention_rows`` call for all decode rows."""
    starts = attn_metadata.query_start_loc.tolist()
    seq_lens = [int(x) for x in attn_metadata.seq_lens.tolist()]
    block_table = attn_metadata.block_table
    decode: list[tuple[int, int]] = []  # (request index, query row): one new token, batched below
    for i, seq_len in enumerate(seq_lens):
        if i + 1 >= len(starts):
            break
        s, e = int(starts[i]), int(starts[i + 1])
        n = e - s
        if n <= 0:
            continue
        if n > seq_len:
            _refuse("attention", f"query of {n} tokens longer than its sequence ({seq_len})")
        if n == 1:
            decode.append((i, s))
            continue
        ATTENTION_CALLS["prefill_with_context" if n < seq_len else "prefill"] += 1
        k, v = gather(block_table[i][None], [seq_len])
        q_pos = torch.arange(seq_len - n, seq_len, dtype=torch.long, device=query.device)
        output[s:e] = ops.attention(query[s:e], k[0], v[0], q_pos, self.scale)
    if decode:
        # every decode row in one call: ops.attention_rows gives each row the bits ops.attention gives
        # it alone (keys past a row's end are exact zeros and masked)
        reqs = torch.tensor([i for i, _ in decode], dtype=torch.long, device=block_table.device)
        rows = torch.tensor([r for _, r in decode], dtype=torch.long, device=query.device)
        lens = [seq_lens[i] for i, _ in decode]
        k, v = gather(block_table.index_select(0, reqs), lens)
        q_pos = torch.tensor(lens, dtype=torch.long, device=query.device)[:, None] - 1
        out = ops.attention_rows(query.index_select(0, rows)[:, None], k, v, q_pos, self.scale)
        output[rows] = out[:, 0]
        ATTENTION_CALLS["decode_rows"] += len(decode)
    return output


# ------------------------------------------------------------------------------------------ attention (CUDA)
# FlashAttention (vLLM 0.32.0, v1/attention/backends/flash_attn.py), written from its source and tested
# on the CPU against a stand-in cache in its layout; never run on a GPU here. Its cache is
# [num_blocks, num_kv_heads, block_size, 2 * head_size] (logical shape; the physical stride order is the
# backend's), and vLLM splits it as ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``: K is the first
# head_size lanes of each (block, head, offset) row, V the second. This plugin owns both the writer and
# the reader, as on the CPU, and reads through the same views vLLM uses, so any stride order works.
def flash_cache_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_cache, value_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_size]`` views."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_cache, value_cache


def _check_flash_impl(self: Any, kv_cache: torch.Tensor, query: torch.Tensor) -> None:
    _check_attention(self, kv_cache, query, windowed=tuple(self.sliding_window) != (-1, -1))
    if self.dcp_world_size != 1:
        _refuse("attention", f"decode context parallelism (dcp_world_size {self.dcp_world_size})")


def flash_kv_cache_update(self: Any, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                          kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``FlashAttentionImpl.do_kv_cache_update``: K and V of each slot into its (block, offset) row of the
    flash layout (what ``reshape_and_cache_flash`` writes for ``kv_cache_dtype: auto``, plain copies)."""
    from vllm.v1.attention.backend import AttentionType

    if self.attn_type in (AttentionType.ENCODER_ONLY, AttentionType.ENCODER):
        return
    _check_flash_impl(self, kv_cache, key)
    key_cache, value_cache = flash_cache_views(kv_cache, self.head_size)
    block_size = key_cache.shape[1]
    slots = slot_mapping.flatten().to(torch.long)
    n = slots.shape[0]  # key / value may be padded past the slot mapping (vLLM's note)
    key, value = key[:n], value[:n]
    valid = slots >= 0  # padded tokens carry slot -1
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


def gather_flash_kv(kv_cache: torch.Tensor, head_size: int, block_rows: torch.Tensor,
                    seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``B`` sequences from the flash layout, ``[B, max(seq_lens), kv_heads, D]``,
    exact zeros past each sequence's end (as :func:`gather_batch_kv` for the CPU layout)."""
    key_cache, value_cache = flash_cache_views(kv_cache, head_size)
    _, block_size, heads, dim = key_cache.shape
    longest = max(seq_lens)
    nblocks = (longest + block_size - 1) // block_size
    ids = block_rows[:, :nblocks].to(torch.long).reshape(-1)
    b = len(seq_lens)
    k = key_cache.index_select(0, ids).reshape(b, nblocks * block_size, heads, dim)[:, :longest]
    v = value_cache.index_select(0, ids).reshape(b, nblocks * block_size, heads, dim)[:, :longest]
    lens = torch.tensor(seq_lens, dtype=torch.long, device=kv_cache.device)
    if bool((lens < longest).any()):
        inside = (torch.arange(longest, device=kv_cache.device)[None, :] < lens[:, None])[:, :, None, None]
        zero = k.new_zeros(())
        k, v = torch.where(inside, k, zero), torch.where(inside, v, zero)
    return k, v


def flash_attention_forward(self: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor,
                            output_scale: torch.Tensor | None = None,
                            output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``FlashAttentionImpl.forward``: causal decoder attention from the flash-layout paged cache through
    the same :func:`_paged_attention` loop (and so the same reference ops) as the CPU replacement."""
    if output_scale is not None or output_block_scale is not None:
        _refuse("attention", "fused output quantization")
    if attn_metadata is None:  # profiling run (vLLM's own returns zeros)
        return output.fill_(0)
    _check_flash_impl(self, kv_cache, query)
    if ON_FIRST_SERVE is not None:
        _first_serve()
    if attn_metadata.causal is not True:
        _refuse("attention", "non-causal or per-sequence (dynamic) causal metadata")
    if attn_metadata.mm_prefix_query_range_tensor is not None or attn_metadata.rswa_prefix_lens is not None:
        _refuse("attention", "multimodal-prefix or R-SWA masks")
    return _paged_attention(self, query, attn_metadata, output,
                            lambda rows, lens: gather_flash_kv(kv_cache, self.head_size, rows, lens))


# ------------------------------------------------------------------------------------------ log-probs
def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``Sampler.compute_logprobs`` (a staticmethod): the full fp32 log-softmax rows that the trainer's
    ``ops.selected_logprobs`` gathers from (``ops.log_softmax`` if the ops module ever defines it;
    otherwise the same expression: ATen's row-wise kernel on fp32, a row's bits depend only on V)."""
    full = getattr(ops, "log_softmax", None)
    if full is not None:
        return full(logits)
    return torch.log_softmax(logits.float(), dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """``topk_topp_sampler.apply_top_k_top_p``: ``ops.apply_top_k_top_p``, the mask the trainer's
    processed replay applies (vLLM's PyTorch semantics, whichever backend vLLM would have picked)."""
    return ops.apply_top_k_top_p(logits, k, p)
