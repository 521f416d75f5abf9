"""Pack a micro-batch of samples into one padding-free row for teacher-forced replay, and attend
within each sequence of it.

All samples' ``prompt_ids + response_ids`` are concatenated into a single ``[1, T]`` row, with
``position_ids`` restarting at 0 for every sequence, so the projections and MLPs run on exactly ``T``
tokens with no padding compute.

**Attention.** transformers 5 detects the packed layout from the position ids alone
(``masking_utils.find_packed_sequence_indices``) and, with sdpa or eager, builds a block-causal
``[T, T]`` mask over the whole row: 64 sequences of 70 tokens cost 20 M scores per head instead of
0.31 M, and that attention was 65-75 % of a training step. :data:`PACKED_ATTENTION` is an attention
implementation registered with transformers (:func:`enable_packed_attention` selects it for a model)
that reads the sequences from ``position_ids`` and runs causal sdpa per sequence: the packed row is
gathered into right-padded ``[S, L_max]`` rows (a view when every sequence has the same length),
attended with ``is_causal`` (a real query never sees the padding after it) and gathered back. The
cost is linear in the number of sequences. Its mask function builds no ``[T, T]`` mask for such a
forward. Anything else (a padding mask, a KV cache, sliding windows) goes to transformers' own sdpa,
so the same model still serves ``generate``. Under CPU autocast it attends in fp32 below 512 tokens (:func:`_sdpa` says
why). Packed log-probs equal the per-sample forwards to 1e-6 in fp32 (``tests/test_packing.py``); the
parity plugin replaces the attention module's forward wholesale and reads the same ``position_ids``.

**Length buckets.** Padding every sequence to the longest wastes the quadratic attention on the short
ones: an SFT batch of 32 tool-use traces of 346 tokens and 32 direct answers of 60 padded all 64 to 346, and
attention was a third of the step (``recipes/search-tiny.yaml``'s warm start, 1 thread). So the sequences
are grouped by length (:func:`_buckets`: a sequence joins a group while it is at least
:data:`BUCKET_RATIO` of the group's longest), each group is attended as its own padded rows, and the real
tokens go back to packed order with one permutation. Batches of about one length stay one group, in
packed order, as before.

**Equal-length rows.** When every sequence of a micro-batch is about as long as the longest (RL
batches of fixed-length responses, e.g. ``ignore_eos``), ``pack(..., uniform_slack=slack_for(model))`` pads
each one at its end to the longest, positions continuing. The attention then sees equal-length
sequences, and the ``[S, L]`` view needs no gather or scatter, in either forward or backward. The
padding sits after every real token of its sequence, so under causal attention no real query sees it,
and the real tokens' log-probs are unchanged: ``tests/test_packing.py`` checks this bitwise in fp32.
On the step benchmark's workload (``benchmarks/grpo_step_vs_floor.py``: 64 x ~76 tokens, 2.4 % padding) a training forward and backward were about
4 % faster padded. Whatever reads every token of the row keeps ``uniform_slack`` at 0: the routers of a
mixture of experts (:func:`slack_for`), and the router aux loss.

Only the logits that predict response tokens are needed: ``target_index[i]`` is the packed position
whose logits predict response token ``i`` (the token just before it), passed to the model as
``logits_to_keep`` so the ``[T, vocab]`` logits tensor is never materialized.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from unirl.multimodal import images_of
from unirl.samples import Sample


@dataclass
class PackedBatch:
    """One micro-batch, packed. ``N`` = total response tokens (masked-in or not), ``S`` = samples."""

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long, restarting at 0 per sequence
    cu_seqlens: torch.Tensor  # [S+1] int32, sequence boundaries in the packed row (padding included)
    target_index: torch.Tensor  # [N] long, packed positions whose logits predict each response token
    target_ids: torch.Tensor  # [N] long, the response tokens themselves
    seq_index: torch.Tensor  # [N] long, sample index 0..S-1 of each response token
    mask: torch.Tensor  # [N] float 0/1, from ``loss_mask``
    seq_lens: torch.Tensor  # [S] float, masked-in response tokens per sample
    response_lens: list[int]  # response tokens per sample (to split [N] back per sample)
    #: each sequence's prompt images (:class:`unirl.multimodal.PromptImages` or None), or None for a text
    #: batch: a vision-language forward takes their pixels (:mod:`unirl.actor.vision_inputs`)
    images: list[Any] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.response_lens)

    @property
    def num_tokens(self) -> int:
        """Response tokens (N), masked-in or not."""
        return int(self.target_index.numel())

    def to(self, device: torch.device | str) -> PackedBatch:
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v.to(device) if isinstance(v, torch.Tensor) else v
        return PackedBatch(**kw)

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Split a flat ``[N]`` per-token tensor back into one tensor per sample."""
        return list(torch.split(flat, self.response_lens))

    def masked_in(self) -> PackedBatch:
        """The same row with only the masked-in response tokens as targets (``mask`` all ones).

        Why: a loss that reads nothing else (SFT's cross-entropy) need not compute the logits of the
        rest, and in agentic traces the rest is most of the response: the observations and tool results
        (loss mask 0). With a word tokenizer's larger vocabulary the output layer is most of the compute."""
        keep = self.mask > 0
        return replace(self, target_index=self.target_index[keep], target_ids=self.target_ids[keep],
                       seq_index=self.seq_index[keep], mask=self.mask[keep],
                       response_lens=[int(n) for n in self.seq_lens.tolist()])


#: the most padding, as a fraction of the packed row, that the training and replay forwards accept for
#: equal-length rows (see the module doc): the gathers it saves cost about 6 % of a forward + backward
UNIFORM_SLACK = 0.05

#: the token id of that padding (any id the vocabulary has; no real token ever attends to it)
PAD_ID = 0


def pack(samples: Sequence[Sample], *, uniform_slack: float = 0.0) -> PackedBatch:
    """Pack samples into one row. Every sample needs a non-empty prompt (its last token predicts the
    first response token); a sample with an empty response contributes no target tokens.

    ``uniform_slack`` > 0: when padding every sequence to the longest adds at most that fraction of
    tokens, pad them (module doc, "Equal-length rows")."""
    if not samples:
        raise ValueError("pack() needs at least one sample")
    lens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    width = max(lens) if uniform_slack > 0 and len(samples) * max(lens) <= (1 + uniform_slack) * sum(lens) else 0
    ids: list[int] = []
    pos: list[int] = []
    cu = [0]
    target: list[int] = []
    target_ids: list[int] = []
    seq_index: list[int] = []
    mask: list[float] = []
    seq_lens: list[float] = []
    response_lens: list[int] = []
    images = [images_of(s) for s in samples]
    for i, s in enumerate(samples):
        if not s.prompt_ids:
            raise ValueError(f"sample {s.id}: empty prompt, nothing predicts the first response token")
        resp = list(s.response_ids)
        lm = list(s.loss_mask) if s.loss_mask else [1] * len(resp)
        if len(lm) != len(resp):
            raise ValueError(f"sample {s.id}: loss_mask has {len(lm)} entries for {len(resp)} response tokens")
        start = len(ids)
        seq = list(s.prompt_ids) + resp
        ids.extend(seq)
        if width:
            ids.extend([PAD_ID] * (width - len(seq)))
        pos.extend(range(max(width, len(seq))))
        cu.append(len(ids))
        first = start + len(s.prompt_ids) - 1  # logits at this position predict response token 0
        target.extend(range(first, first + len(resp)))
        target_ids.extend(resp)
        seq_index.extend([i] * len(resp))
        m = [1.0 if x else 0.0 for x in lm]
        mask.extend(m)
        seq_lens.append(sum(m))
        response_lens.append(len(resp))
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([pos], dtype=torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        target_index=torch.tensor(target, dtype=torch.long),
        target_ids=torch.tensor(target_ids, dtype=torch.long),
        seq_index=torch.tensor(seq_index, dtype=torch.long),
        mask=torch.tensor(mask, dtype=torch.float32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.float32),
        response_lens=response_lens,
        images=images if any(im is not None for im in images) else None,
    )


def flatten(per_sample: Sequence[torch.Tensor], packed: PackedBatch, name: str = "tensor") -> torch.Tensor:
    """Concatenate per-sample 1-D tensors aligned with the responses into the packed ``[N]`` order,
    checking each length against the sample's response."""
    if len(per_sample) != packed.num_seqs:
        raise ValueError(f"{name}: {len(per_sample)} tensors for {packed.num_seqs} samples")
    out = []
    for i, (t, n) in enumerate(zip(per_sample, packed.response_lens, strict=True)):
        t = torch.as_tensor(t)
        if t.numel() != n:
            raise ValueError(f"{name}[{i}]: {t.numel()} entries for {n} response tokens")
        out.append(t.reshape(-1).to(torch.float32))
    if not out:
        return torch.zeros(0)
    return torch.cat(out)


# ------------------------------------------------------------------------------ packed attention

#: the transformers attention implementation name :func:`enable_packed_attention` selects
PACKED_ATTENTION = "unirl_packed"


#: a sequence joins a length bucket of the packed attention while it is at least this fraction of the
#: bucket's longest (module doc, "Length buckets")
BUCKET_RATIO = 0.75


@dataclass
class _Bucket:
    """Sequences of about one length, attended together as ``[n, h, L, D]`` right-padded rows:
    ``gather [n * L]`` indexes the flat tokens (``B * T`` = a zero row for padding), ``keep [n * L]``
    marks the real slots."""

    n: int
    L: int
    gather: torch.Tensor
    keep: torch.Tensor


def _buckets(lens: list[int]) -> list[list[int]]:
    """Sequence indices grouped by length, longest first: a sequence joins the current group while it is
    at least :data:`BUCKET_RATIO` of the group's longest, so no sequence is padded past 1/ratio of its
    length. One group keeps the packed order (no permutation needed)."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lens[i] >= BUCKET_RATIO * lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(g) for g in groups] if len(groups) > 1 else [list(range(len(lens)))]


_Plan = tuple[int, int, list[_Bucket], torch.Tensor | None]

#: the last plan and what it was built from: ``(position_ids, its _version, B, T, plan)``. Every attention
#: layer of one forward gets the same ``position_ids`` tensor, so the plan (a sort, a nonzero, one small
#: tensor per bucket; ~0.6 ms at 64 mixed sequences) is built once per forward, not once per layer. The
#: strong reference keeps the tensor's id from being reused; ``_version`` catches an in-place edit. One
#: tuple, swapped whole, so a reader on another thread never sees half of it.
_last_plan: tuple | None = None


def _sequence_plan(position_ids: torch.Tensor, B: int, T: int) -> _Plan:
    """:func:`_build_plan`, cached for the ``position_ids`` tensor the previous call saw (see
    :data:`_last_plan`)."""
    global _last_plan
    last = _last_plan
    if (last is not None and last[0] is position_ids and last[1] == position_ids._version
            and last[2] == B and last[3] == T):
        return last[4]
    plan = _build_plan(position_ids, B, T)
    _last_plan = (position_ids, position_ids._version, B, T, plan)
    return plan


def _build_plan(position_ids: torch.Tensor, B: int, T: int) -> _Plan:
    """Sequences of the ``[B, T]`` rows from ``position_ids`` (a new one wherever a position does not
    continue the previous one, and at every row start): ``(S, uniform_len, buckets, inverse)``.

    ``uniform_len`` > 0 when every sequence has that length (the rows then reshape to ``[S, L]``, no
    gather, no buckets). Otherwise the sequences are grouped into length :class:`_Bucket` s; ``inverse``
    (None for one bucket) puts the real tokens of the buckets, concatenated in bucket order, back in
    packed order."""
    pos = position_ids.expand(B, T).reshape(-1)
    start = torch.ones_like(pos, dtype=torch.bool)
    if pos.numel() > 1:
        start[1:] = pos[1:] != pos[:-1] + 1
    start[::T] = True
    starts = start.nonzero()[:, 0]
    lens = torch.diff(starts, append=starts.new_tensor([pos.numel()]))
    S = int(starts.numel())
    lo, hi = (int(x) for x in torch.aminmax(lens))
    if lo == hi:
        return S, hi, [], None
    buckets, dest = [], []
    for idx in _buckets(lens.tolist()):
        sel = torch.tensor(idx, device=pos.device)
        b_starts, b_lens = starts[sel], lens[sel]
        L = int(b_lens.max())
        slot = torch.arange(L, device=pos.device)
        keep = (slot[None, :] < b_lens[:, None]).reshape(-1)
        gather = (b_starts[:, None] + slot[None, :]).reshape(-1)
        buckets.append(_Bucket(len(idx), L, torch.where(keep, gather, gather.new_tensor(pos.numel())), keep))
        dest.append(gather[keep])
    inverse = torch.argsort(torch.cat(dest)) if len(buckets) > 1 else None
    return S, 0, buckets, inverse


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, **kwargs):
    """transformers attention interface (``query [B, H, T, D]``, ``key`` / ``value [B, Hkv, T, D]``)
    -> ``([B, T, H, D], None)``: causal attention within each sequence ``position_ids`` marks.

    Falls back to transformers' sdpa for anything that is not a mask-free, cache-free forward."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    pos = kwargs.get("position_ids")
    B, H, T, D = query.shape
    if (attention_mask is not None or sliding_window or pos is None or key.shape[2] != T
            or not getattr(module, "is_causal", True)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    S, uniform, buckets, inverse = _sequence_plan(pos, B, T)
    gqa = key.shape[1] != H

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [n, h, L, D] -> [n, L, H, D]
        return _sdpa(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa).transpose(1, 2)

    def flat(x: torch.Tensor) -> torch.Tensor:  # [B, h, T, D] -> [B * T, h, D]
        return x.transpose(1, 2).reshape(B * T, x.shape[1], D)

    if uniform:
        q, k, v = (flat(x).view(S, uniform, x.shape[1], D).transpose(1, 2) for x in (query, key, value))
        return attend(q, k, v).reshape(B, T, H, D), None
    padded = [torch.cat([flat(x), x.new_zeros(1, x.shape[1], D)]) for x in (query, key, value)]
    outs = []
    for b in buckets:
        q, k, v = (x.index_select(0, b.gather).view(b.n, b.L, x.shape[1], D).transpose(1, 2) for x in padded)
        outs.append(attend(q, k, v).reshape(b.n * b.L, H, D)[b.keep])
    out = outs[0] if inverse is None else torch.cat(outs).index_select(0, inverse)
    return out.view(B, T, H, D), None


#: under CPU autocast, sequences of at least this many tokens attend in autocast's dtype (see :func:`_sdpa`)
LOW_PRECISION_ATTENTION_MIN_LEN = 512


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """Causal sdpa, under CPU autocast in fp32 up to :data:`LOW_PRECISION_ATTENTION_MIN_LEN` tokens and in
    autocast's dtype from there (the result in autocast's dtype either way).

    Why: PyTorch's CPU flash-attention backward is 2.6x slower in bf16 than in fp32 for short sequences
    (74 vs 28 ms for ``[64, 8, 82, 64]`` q, GQA, causal, 2 threads), while its forward and every matmul
    around it are faster in bf16 (AMX). Under autocast transformers' rotary embedding already leaves q and
    k in fp32, and autocast would cast them down only for sdpa; keeping them fp32 took a 25 M bf16
    training forward + backward from about 2.0 s to 1.5 s, with the more exact softmax. From about 512
    tokens the bf16 kernel is the faster one (forward + backward, 12 heads / 4 KV heads of 64, 2 threads,
    AMD EPYC: fp32 / bf16 17.4 / 19.8 ms at 272 tokens, 20.4 / 19.6 at 528, 33.0 / 28.7 at 784, 55.7 / 47.1
    at 1,040). Only CPU autocast is touched: without it (fp32 models, every parity path) the attention runs
    as written, bit for bit, and on a GPU the bf16 flash kernels are the fast ones."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if q.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return sdpa(q, k, v, **kwargs)
    dtype = torch.get_autocast_dtype("cpu")
    with torch.autocast("cpu", enabled=False):
        if q.shape[2] >= LOW_PRECISION_ATTENTION_MIN_LEN:
            return sdpa(q.to(dtype), k.to(dtype), v.to(dtype), **kwargs)
        return sdpa(q.float(), k.float(), v.float(), **kwargs).to(dtype)


def _packed_mask(*, attention_mask: torch.Tensor | None = None, q_length: int = 0, kv_length: int = 0,
                 q_offset: int = 0, **kwargs):
    """The mask function of :data:`PACKED_ATTENTION`: none for a mask-free, cache-free forward (the
    attention reads the sequences from ``position_ids``), transformers' sdpa mask otherwise."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and q_length == kv_length and not q_offset:
        return None
    return sdpa_mask(attention_mask=attention_mask, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     **kwargs)


_registered = False


def register_packed_attention() -> None:
    """Register :data:`PACKED_ATTENTION` (attention + mask function) with transformers, once."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, _packed_mask)
    _registered = True


#: decoder families whose layers hand ``position_ids`` to the attention interface (checked in
#: transformers 5.19); without them a packed row could not be split, so others keep sdpa's row mask
PACKED_ATTENTION_FAMILIES = ("qwen3", "qwen3_moe", "qwen2", "llama")


def packed_attention_supported(model: torch.nn.Module) -> bool:
    """Whether ``model`` can take :data:`PACKED_ATTENTION`: a decoder of
    :data:`PACKED_ATTENTION_FAMILIES` on sdpa (or already on it) whose layers are all full causal
    attention."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "_attn_implementation", None) not in ("sdpa", PACKED_ATTENTION):
        return False
    if getattr(cfg, "model_type", None) not in PACKED_ATTENTION_FAMILIES:
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return False
    return not getattr(cfg, "sliding_window", None) or not getattr(cfg, "use_sliding_window", False)


def enable_packed_attention(model: torch.nn.Module) -> bool:
    """Select :data:`PACKED_ATTENTION` for ``model`` when :func:`packed_attention_supported`; return
    whether it did. A model on another implementation (eager, flash, flex) keeps it."""
    if not packed_attention_supported(model):
        return False
    register_packed_attention()
    model.set_attn_implementation(PACKED_ATTENTION)
    return True


def slack_for(model: torch.nn.Module) -> float:
    """The ``uniform_slack`` to pack ``model``'s micro-batches with: :data:`UNIFORM_SLACK` for a dense
    decoder on :data:`PACKED_ATTENTION`, whose equal-length rows skip the gathers. 0 on anything else:
    a mask over the whole row only grows with the padding, and a mixture of experts routes every token
    of the row, so its router statistics (the aux loss, the parity gate's routing diagnostics) would
    count the padding."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "_attn_implementation", None) != PACKED_ATTENTION or getattr(cfg, "num_experts", 0):
        return 0.0
    return UNIFORM_SLACK


def disable_packed_attention(model: torch.nn.Module) -> None:
    """Put a model that :func:`enable_packed_attention` switched back on sdpa (e.g. a copy that will
    ``generate`` through a fast path that checks the implementation name)."""
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "_attn_implementation", None) == PACKED_ATTENTION:
        model.set_attn_implementation("sdpa")
