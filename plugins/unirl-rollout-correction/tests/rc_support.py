"""Test and benchmark support: an engine that serves *perturbed* weights (a real rollout/trainer
mismatch), and synthetic batches with ragged, empty and masked rows.

:class:`PerturbedSync` is the run's weight sync with every tensor multiplied by ``1 + sigma * noise``
on its way into the engine (fixed noise per tensor name, so every sync serves the same perturbed
policy: a systematic mismatch like a lower-precision engine). The engine's receipts still agree with
the sender's fingerprint (what streamed past *is* the perturbed set), so the version ledger commits.
:func:`perturb_engine` swaps it in under the sync's registered name, in one kernel, for one process.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch

from unirl.api import InProcessSync, Sample


class _NoisyWeights:
    """An actor stand-in whose ``named_weights`` are the actor's times (1 + sigma * N(0, 1))."""

    def __init__(self, actor: Any, sigma: float, seed: int) -> None:
        self.actor, self.sigma, self.seed = actor, sigma, seed

    def named_weights(self):
        for name, t in self.actor.named_weights():
            key = int.from_bytes(hashlib.sha256(f"{self.seed}:{name}".encode()).digest()[:8], "little")
            g = torch.Generator().manual_seed(key)
            noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
            yield name, (t.detach().float() * (1.0 + self.sigma * noise)).to(t.dtype)


def perturbed_sync_class(base: type, sigma: float, seed: int = 0) -> type:
    """A subclass of the weight sync ``base`` that publishes perturbed weights."""

    class PerturbedSync(base):  # type: ignore[misc, valid-type]
        def publish(self, actor, engine, version):
            return super().publish(_NoisyWeights(actor, sigma, seed), engine, version)

    PerturbedSync.__name__ = f"Perturbed{base.__name__}"
    return PerturbedSync


def perturb_engine(kernel: Any, sync_name: str, sigma: float, seed: int = 0) -> None:
    """Make ``weight_sync.name: sync_name`` publish perturbed weights in runs built from ``kernel``."""
    entry = kernel.get("weight_syncs", sync_name)
    base = entry.load()
    assert issubclass(base, InProcessSync), base
    entry.factory = perturbed_sync_class(base, sigma, seed)


def ragged_samples(seed: int = 0) -> list[Sample]:
    """Ragged responses including an empty one, a partially masked one and a fully masked one."""
    rng = random.Random(seed)
    out = []
    lens = [5, 1, 0, 7, 3, 6, 4, 2]
    for i, n in enumerate(lens):
        mask = [1] * n
        if i == 3:
            mask[1] = mask[4] = 0  # partial (tool observations)
        if i == 5:
            mask = [0] * n  # fully masked (e.g. a failed sample)
        out.append(Sample(id=f"p{i // 2}@t/{i % 2}", prompt_ids=[rng.randrange(3, 200) for _ in range(3)],
                          response_ids=[rng.randrange(3, 200) for _ in range(n)], loss_mask=mask, status="ok",
                          reward=0.0))
    return out


def synthetic_batch(samples: list[Sample], *, seed: int = 1, mismatch: float = 0.5, drift: float = 0.3
                    ) -> dict[str, list[torch.Tensor]]:
    """old (pi_old), rollout (= old + mismatch noise), logp (current = old + drift noise), advantages;
    float64. A few tokens get a large mismatch so that truncation and masking happen."""
    g = torch.Generator().manual_seed(seed)
    old, roll, logp, adv = [], [], [], []
    for s in samples:
        n = len(s.response_ids)
        o = -torch.rand(n, generator=g, dtype=torch.float64) * 3 - 0.05
        r = o + torch.randn(n, generator=g, dtype=torch.float64) * mismatch
        r = torch.minimum(r, torch.zeros_like(r))  # log-probs are <= 0
        old.append(o)
        roll.append(r)
        logp.append(o + torch.randn(n, generator=g, dtype=torch.float64) * drift)
        adv.append(torch.randn(n, generator=g, dtype=torch.float64))
    return {"old_logprobs": old, "rollout_logprobs": roll, "logp": logp, "advantages": adv}
