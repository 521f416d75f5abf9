"""The distribution a sampled token's log-prob is taken under: raw, or processed as vLLM samples.

``rollout.logprobs`` names it for the whole run, and both sides follow it:

* ``raw``: ``log_softmax(logits)`` of the model's fp32 logits (no temperature, top-k or top-p);
* ``processed``: the distribution the token was drawn from. The logits are processed in vLLM's order
  (``vllm/v1/sample/sampler.py``: ``Sampler.sample`` -> ``apply_temperature``, then
  ``ops/topk_topp_sampler.py:apply_top_k_top_p``), then ``log_softmax`` in fp32 (what vLLM returns under
  ``logprobs_mode: processed_logprobs``). The engine reports it, and the actor replays it with the
  training samples' sampling settings (``rollout.temperature / top_k / top_p``: the trainer samples every
  training turn with them, :meth:`unirl.contracts.SamplingParams.from_config`), so the ratio pi / pi_old
  is between the distributions the tokens were really drawn from.

Why one implementation here, in core: the actor needs it whether or not parity is on, the embedded
engine samples from it, and the parity plugin installs :func:`apply_top_k_top_p` into vLLM's sampler,
so the masks on both sides come from the same code (``unirl_parity_vllm.ops``).

vLLM's semantics, copied exactly (vLLM 0.32, the PyTorch path the CPU takes):

* temperature: ``logits / T`` with ``T`` an fp32 tensor, one IEEE division per element; a temperature
  below ``1e-5`` is greedy, and vLLM's greedy rows report the *unprocessed* log-probs;
* top-k: keep every logit ``>=`` the k-th largest (ties at the boundary are all kept); ``k`` of 0 or
  ``>= V`` is off;
* top-p: sort ascending, ``softmax`` of the sorted row (top-k's ``-inf`` included), ``cumsum``; drop a
  token when the cumulative mass up to and including it is ``<= 1 - p`` (fp32), the largest always
  kept: so the token whose mass crosses ``p`` is kept. ``p >= 1`` is off;
* masked logits become ``-inf``; a row's result depends only on that row (sort, softmax and cumsum
  are row-wise), so a token's bits do not depend on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from unirl.config import RunConfig

LogprobsKind = Literal["raw", "processed"]

#: vLLM's ``_SAMPLING_EPS``: a temperature below it samples greedily
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class LogprobProcessing:
    """Temperature, top-k (0: off) and top-p (1.0: off) applied before the log-softmax."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def of_run(cls, config: RunConfig) -> LogprobProcessing | None:
        """The processing of the run's training samples, or None for ``rollout.logprobs: raw``."""
        r = config.rollout
        if r.logprobs == "raw":
            return None
        return cls(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def apply_top_k_top_p(logits: Tensor, k: Tensor | None, p: Tensor | None) -> Tensor:
    """vLLM's ``apply_top_k_top_p(logits [B, V] fp32, k [B] | None, p [B] fp32 | None)``, in place.

    The signature is vLLM's, so the parity plugin installs this very function into vLLM's sampler. The
    top-k-only case uses ``topk`` instead of a full sort, as vLLM does: the kept set is the same (the
    k-th largest value is a value, whichever way it is found)."""
    import torch

    if p is None:
        if k is None:
            return logits
        no_top_k = k == logits.shape[1]
        kk = k.masked_fill(no_top_k, 1).to(torch.long)
        kth = logits.topk(int(kk.max()), dim=1).values.gather(1, (kk - 1).unsqueeze(1))
        kth.masked_fill_(no_top_k.unsqueeze(1), -float("inf"))
        return logits.masked_fill_(logits < kth, -float("inf"))
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        kth = logits_sort.gather(1, (logits_sort.size(1) - k.to(torch.long)).unsqueeze(dim=1))
        logits_sort.masked_fill_(logits_sort < kth, -float("inf"))
    probs_sort = logits_sort.softmax(dim=-1)
    probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort)
    drop = probs_sum <= 1 - p.unsqueeze(dim=1)
    drop[:, -1] = False  # at least one
    logits_sort.masked_fill_(drop, -float("inf"))
    return logits.scatter_(dim=-1, index=logits_idx, src=logits_sort)


def process_logits(logits: Tensor, processing: LogprobProcessing) -> Tensor:
    """fp32 ``logits [N, V]`` after temperature, top-k and top-p. A new tensor, except when there is
    nothing to do (greedy, or temperature 1 with neither top-k nor top-p): then ``logits.float()``,
    which may be ``logits`` itself, so callers must not write into the result."""
    import torch

    n, vocab = logits.shape
    k_on, p_on = 0 < processing.top_k < vocab, processing.top_p < 1
    if processing.greedy or (processing.temperature == 1.0 and not k_on and not p_on):
        return logits.float()  # x / 1.0 is x, bit for bit; nothing to mask
    x = logits.float().clone()
    x.div_(torch.full((n, 1), processing.temperature, dtype=torch.float32, device=x.device))
    k = torch.full((n,), processing.top_k, dtype=torch.int32, device=x.device) if k_on else None
    p = torch.full((n,), processing.top_p, dtype=torch.float32, device=x.device) if p_on else None
    return apply_top_k_top_p(x, k, p)


def logprobs_of(logits: Tensor, processing: LogprobProcessing | None, sampled: Tensor | None = None) -> Tensor:
    """fp32 log-probs ``[N, V]`` of ``logits`` under ``processing`` (None: raw); differentiable through
    the kept logits (the masks are constants).

    ``sampled`` (``[N]`` token ids): tokens that were drawn, kept even where this side's top-k / top-p
    would drop them. The engine drew each from its own kept set, so where both sides compute the same
    logits (parity) this changes no bit; where they differ in the last bits (no parity) or the engine
    served other weights, a token at the boundary gets a finite log-prob (a mismatch the gate counts, a
    ratio the loss can use) instead of ``-inf``."""
    import torch

    if processing is None:
        return torch.log_softmax(logits.float(), dim=-1)
    if processing.greedy:
        return torch.log_softmax(logits.float(), dim=-1)  # vLLM's greedy rows: unprocessed
    x = logits.float() / torch.full((logits.shape[0], 1), processing.temperature, dtype=torch.float32,
                                    device=logits.device)
    with torch.no_grad():
        keep = process_logits(logits.detach(), processing) > -float("inf")
        if sampled is not None:
            keep.scatter_(-1, sampled.reshape(-1, 1).long(), True)
    return torch.log_softmax(x.masked_fill(~keep, -float("inf")), dim=-1)


def selected_logprobs(logits: Tensor, tokens: Tensor, processing: LogprobProcessing | None = None) -> Tensor:
    """fp32 ``log p(tokens[i] | logits[i])`` under ``processing`` (None: raw): what an engine reports
    for a sampled token and what the actor replays (``tokens`` were drawn: kept, see :func:`logprobs_of`)."""
    tokens = tokens.reshape(-1).long()
    return logprobs_of(logits, processing, sampled=tokens).gather(-1, tokens[:, None]).squeeze(-1)
