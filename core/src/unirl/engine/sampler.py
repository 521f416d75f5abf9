"""Seeded sampling for the embedded engine: a counter-based RNG, so a row's draw depends on its own seed only.

Sampling is vectorised over the batch and keyed per row: every row carries a 63-bit seed
(``sample.turn_seed()``, keyed on the request and its depth, or one drawn from the engine's own
generator for an unseeded sample), and the Gumbel noise for step ``t`` of that row is a
counter-based hash of ``(seed, t, token id)``. A seeded request therefore draws the same tokens alone,
in any batch, at any step, with no per-row Python loop.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.contracts import SamplingParams

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)


def _i64(v: int) -> int:
    """``v`` modulo 2**64 as a signed int64 value."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on an int64 tensor, in place (multiplication wraps modulo 2**64)."""
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        t = z >> shift  # logical shift: torch's >> is arithmetic, so mask the sign bits off
        t &= (1 << (64 - shift)) - 1
        z ^= t
        if mult is not None:
            z *= mult
    return z


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """:func:`_mix64_` on a copy."""
    return _mix64_(z.clone())


@functools.cache
def _token_keys(vocab: int, device: str) -> torch.Tensor:
    """``[vocab]`` int64: token id ``i``'s offset ``(i + 1) * gamma`` (wrapping), made once per vocabulary."""
    import torch

    return torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _GAMMA


def gumbel_noise(seeds: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise of shape ``[rows, vocab]``; row r depends only on ``(seeds[r], step)``.

    Computed in place on one ``[rows, vocab]`` buffer: at a decode step's sizes the cost is the
    allocations and dispatches, not the arithmetic."""
    import torch

    key = _mix64_(_mix64(seeds) + _i64((step + 1) * _GAMMA))  # [B]
    h = _mix64_(key[:, None] + _token_keys(vocab, str(seeds.device))[None, :])
    h >>= 40
    h &= (1 << 24) - 1
    u = h.to(torch.float32).add_(0.5).mul_(1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    return u.log_().neg_().log_().neg_()


def sample_tokens(logits: torch.Tensor, sampling: SamplingParams, seeds: torch.Tensor, step: int) -> torch.Tensor:
    """Pick one token per row from fp32 ``logits [B, V]`` under temperature / top-k / top-p."""
    import torch

    if sampling.temperature == 0:
        return logits.argmax(-1)
    x = logits / sampling.temperature if sampling.temperature != 1.0 else logits  # x / 1.0 is x, bit for bit
    vocab = x.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if sampling.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) > sampling.top_p
        drop[:, 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -math.inf)
    return (x + gumbel_noise(seeds, step, vocab)).argmax(-1)
