"""Pack a micro-batch of samples into one padding-free row for teacher-forced replay.

All samples' ``prompt_ids + response_ids`` are concatenated into a single ``[1, T]`` row, with
``position_ids`` restarting at 0 for every sequence. transformers 5 detects this layout from the
position ids alone (``masking_utils.find_packed_sequence_indices``: a new sequence starts wherever
``position_ids[t] - position_ids[t-1] != 1``) and builds a block-causal mask for sdpa / eager / flex,
provided that ``attention_mask`` is ``None`` and no KV cache is passed. So a packed forward equals the
per-sample forwards (verified to 1e-6 in fp32 by ``tests/test_packing.py``) with no padding compute.
Flash-attention backends read the same layout from the position ids (``cu_seqlens`` is kept here for
them and for varlen kernels).

Only the logits that predict response tokens are needed: ``target_index[i]`` is the packed position
whose logits predict response token ``i`` (the token just before it), passed to the model as
``logits_to_keep`` so the ``[T, vocab]`` logits tensor is never materialized.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from unirl.samples import Sample


@dataclass
class PackedBatch:
    """One micro-batch, packed. ``N`` = total response tokens (masked-in or not), ``S`` = samples."""

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long, restarting at 0 per sequence
    cu_seqlens: torch.Tensor  # [S+1] int32, sequence boundaries in the packed row
    target_index: torch.Tensor  # [N] long, packed positions whose logits predict each response token
    target_ids: torch.Tensor  # [N] long, the response tokens themselves
    seq_index: torch.Tensor  # [N] long, sample index 0..S-1 of each response token
    mask: torch.Tensor  # [N] float 0/1, from ``loss_mask``
    seq_lens: torch.Tensor  # [S] float, masked-in response tokens per sample
    response_lens: list[int]  # response tokens per sample (to split [N] back per sample)

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


def pack(samples: Sequence[Sample]) -> PackedBatch:
    """Pack samples into one row. Every sample needs a non-empty prompt (its last token predicts the
    first response token); a sample with an empty response contributes no target tokens."""
    if not samples:
        raise ValueError("pack() needs at least one sample")
    ids: list[int] = []
    pos: list[int] = []
    cu = [0]
    target: list[int] = []
    target_ids: list[int] = []
    seq_index: list[int] = []
    mask: list[float] = []
    seq_lens: list[float] = []
    response_lens: list[int] = []
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
        pos.extend(range(len(seq)))
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
