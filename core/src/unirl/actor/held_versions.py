"""Older weight versions kept by an actor, and a replay against one of them (the mismatch diagnostics).

Why: in async and stream modes a batch was sampled by weights the trainer has since moved past. To
tell the engine's numerics from that staleness (:mod:`unirl.mismatch`, docs/mismatch.md), the trainer
replays the batch at the version that sampled it. An actor keeps a CPU copy of its trainable tensors
at each publish (only the versions still in the staleness window) and, to replay, copies one in, runs
its ordinary replay (same micro-batches, same numerics) and copies the live tensors back: copies only,
so the weights are back bit for bit. Each FSDP rank keeps and swaps its own shards (``_local``).

A mixin of :class:`unirl.actor.skeleton.ActorSkeleton`, so the embedded actor and every FSDP rank
implement :meth:`unirl.contracts.Actor.hold_version` / ``logprobs_at`` with the same code.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from unirl.kernel.errors import UniRLError

if TYPE_CHECKING:  # pragma: no cover
    from unirl.samples import Sample


class VersionNotHeldError(UniRLError, ValueError):
    """A replay asked for a weight version the actor does not hold; names the held ones."""


class HeldVersions:
    """``hold_version`` and the replay at a held version, over the skeleton's ``_replay``."""

    keeps_versions = True  # unirl.contracts.Actor.keeps_versions
    model: torch.nn.Module
    _held: dict[int, list[Tensor]]

    @staticmethod
    def _local(t: Tensor) -> Tensor:
        """This rank's part of a possibly sharded parameter, sharing its storage (identity here)."""
        return t

    def _versioned(self) -> list[torch.nn.Parameter]:
        """What changes between versions: the trainable parameters (with ``actor.lora``, the adapter)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def hold_version(self, version: int, keep: Collection[int]) -> None:
        """:meth:`unirl.contracts.Actor.hold_version`: a CPU copy of this rank's trainable tensors."""
        self._after_replay()  # FSDP: resharded, so the local shards are this rank's whole state
        self._held = {v: w for v, w in self._held.items() if v in keep}
        if version in keep:
            with torch.no_grad():
                self._held[version] = [self._local(p).detach().to("cpu", copy=True) for p in self._versioned()]

    def _replay_at(self, version: int, samples: Sequence[Sample], *, count: int | None = None) -> list[Tensor]:
        """:meth:`unirl.contracts.Actor.logprobs_at`: the held tensors copied in, the replay, the live
        ones copied back whatever the replay raised."""
        held = self._held.get(version)
        if held is None:
            raise VersionNotHeldError(f"weight version {version} is not held (held: {sorted(self._held)}): "
                                      "hold_version must run at its publish")
        params = self._versioned()
        self._after_replay()
        with torch.no_grad():
            live = [self._local(p).detach().to("cpu", copy=True) for p in params]
            try:
                for p, w in zip(params, held, strict=True):
                    self._local(p).copy_(w)
                return self._replay(self.model, samples, phase="replay", count=count)
            finally:
                for p, w in zip(params, live, strict=True):
                    self._local(p).copy_(w)

    # provided by the skeleton
    def _after_replay(self) -> None: ...  # pragma: no cover

    def _replay(self, model: torch.nn.Module, samples: Sequence[Sample], *, phase: str, values: bool = False,
                count: int | None = None) -> Any: ...  # pragma: no cover
