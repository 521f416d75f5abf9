"""Seeded sampling for the embedded engine: a counter-based RNG, so a row's draw depends on its own seed only.

Sampling is vectorised over the batch and keyed per row: every row carries a 63-bit seed
(``sample.turn_seed()``, keyed on the request and its depth, or one drawn from the engine's own
generator for an unseeded sample), and the Gumbel noise for step ``t`` of that row is a
counter-based hash of ``(seed, t, token id)``. A seeded request therefore draws the same tokens alone,
in any batch, at any step, with no per-row Python loop.
"""

from __future__ import annotations

import functools
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


def gumbel_noise(seeds: torch.Tensor, step: int | torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise of shape ``[rows, vocab]``; row r depends only on ``(seeds[r], step)``.

    ``step`` is one int for every row, or an int64 tensor of each row's own step (the merged batch of
    :mod:`unirl.engine.merged`, whose rows started at different steps): int64 products wrap modulo 2**64
    like :func:`_i64`, so both give the same bits for the same step.
    Computed in place on one ``[rows, vocab]`` buffer: at a decode step's sizes the cost is the
    allocations and dispatches, not the arithmetic."""

    offset = _i64((step + 1) * _GAMMA) if isinstance(step, int) else (step + 1) * _GAMMA
    key = _mix64_(_mix64(seeds) + offset)  # [B]
    h = _mix64_(key[:, None] + _token_keys(vocab, str(seeds.device))[None, :])
    h >>= 40
    h &= (1 << 24) - 1
    return _open_unit(h).log_().neg_().log_().neg_()


def _open_unit(h: torch.Tensor) -> torch.Tensor:
    """24-bit integers ``h`` -> fp32 uniforms strictly inside (0, 1).

    ``(h + 0.5) / 2**24`` at the top value, 1 - 2**-25, rounds to 1.0 in fp32; its Gumbel noise is
    +inf, and +inf on a masked (-inf) logit is NaN, which argmax picks: a token outside top-k / top-p
    was drawn about once in 2**24 draws (a real run hit it). Clamped to the largest fp32 below 1; every
    other value keeps its bits."""
    import torch

    return h.to(torch.float32).add_(0.5).mul_(1.0 / (1 << 24)).clamp_(max=1.0 - 2.0**-24)


def sampling_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """fp32 ``logits [B, V]`` after temperature, top-k and top-p in vLLM's order and semantics
    (:func:`unirl.logprobs.process_logits`): the distribution a token is drawn from, and under
    ``rollout.logprobs: processed`` the one its log-prob is reported under. May alias ``logits``."""
    from unirl.logprobs import LogprobProcessing, process_logits

    return process_logits(logits, LogprobProcessing(sampling.temperature, sampling.top_k, sampling.top_p))


def draw(x: torch.Tensor, sampling: SamplingParams, seeds: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """One token per row of processed logits ``x`` (:func:`sampling_logits`): argmax when greedy
    (temperature below vLLM's 1e-5), else Gumbel-max with the rows' own noise."""
    from unirl.logprobs import SAMPLING_EPS

    if sampling.temperature < SAMPLING_EPS:
        return x.argmax(-1)
    return (x + gumbel_noise(seeds, step, x.shape[-1])).argmax(-1)


def sample_tokens(logits: torch.Tensor, sampling: SamplingParams, seeds: torch.Tensor, step: int) -> torch.Tensor:
    """Pick one token per row from fp32 ``logits [B, V]`` under temperature / top-k / top-p."""
    return draw(sampling_logits(logits, sampling), sampling, seeds, step)
