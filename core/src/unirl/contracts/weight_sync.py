"""How a new policy version reaches the engines: the transport contract, the receipts each worker
answers with, and the ledger that only a verified sync advances."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from unirl.kernel.errors import WeightSyncError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.contracts.actor import Actor
    from unirl.contracts.engine import RolloutEngine


@dataclass(frozen=True)
class Receipt:
    """One engine worker's answer to a weight sync: what it loaded, fingerprinted."""

    worker: int
    version: int
    fingerprint: str
    num_tensors: int = 0
    seconds: float = 0.0
    #: how the bytes reached this worker (:mod:`unirl.sync.transport`: inprocess, shm, object_store; an
    #: HTTP engine names its own, e.g. SGLang's disk or nccl)
    transport: str = "inprocess"
    node: str | None = None  # where the worker runs: its Ray node id, or a server URL (None: this process)
    #: the worker's tensor-parallel rank inside its engine (None: the engine has no TP)
    tp_rank: int | None = None
    #: fingerprint of the parameters the worker holds after the load (its TP shard, as vLLM's weight
    #: loaders cut it); ``fingerprint`` is of the full tensors it received, the one every rank must share
    shard_fingerprint: str | None = None


@dataclass
class VersionLedger:
    """The policy version the engines serve. Only a committed sync advances it."""

    version: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)

    def commit(self, version: int, receipts: list[Receipt], manifest_fingerprint: str) -> None:
        verify_receipts(version, receipts, manifest_fingerprint)
        self.version = version
        self.history.append({"version": version, "fingerprint": manifest_fingerprint,
                             "workers": [r.worker for r in receipts],
                             "transports": sorted({r.transport for r in receipts})})


def verify_receipts(version: int, receipts: list[Receipt], manifest_fingerprint: str) -> None:
    """Raise :class:`WeightSyncError` unless every worker received exactly the sender's manifest.

    The trainer's :class:`VersionLedger` commits through this, and an engine that restores its old
    weights on a mismatch checks with it too; neither keeps a second ledger."""
    bad = [r for r in receipts if r.fingerprint != manifest_fingerprint or r.version != version]
    if not receipts or bad:
        raise WeightSyncError(
            f"weight sync to version {version} not committed: "
            + (f"{len(bad)} of {len(receipts)} receipts disagree with the sender's manifest "
               f"({manifest_fingerprint[:12]}): {bad}" if receipts else "no receipts")
        )


def fingerprint(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over the ordered (name, shape, dtype, bytes) of tensors: the receipt's oracle.

    Sender and receiver compute it independently; equal fingerprints prove the bytes arrived.
    """
    import torch

    h = hashlib.sha256()
    for name, t in named_tensors:
        t = t.detach().contiguous().cpu()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(-1).view(torch.uint8).numpy())  # the buffer itself: no bytes copy
    return h.hexdigest()


#: the tensors file of a peft adapter directory (``save_pretrained``)
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_fingerprint(path: str) -> str:
    """:func:`fingerprint` of the tensors in the peft adapter directory ``path``, in sorted name order:
    what the sender wrote and what an engine was given must agree (the adapter sync's receipt). It covers
    the adapter file's tensors, not the engine's internal copy of them nor its base weights."""
    import os

    from safetensors.torch import load_file

    tensors = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    return fingerprint(sorted(tensors.items()))


class WeightSync(ABC):
    """Moves weights from an actor into an engine; the only way a new version is published.

    Built as ``factory(config=RunConfig, options=Config | None)``: ``weight_sync.options`` as the
    kernel validated it against the class's ``Config`` (None: it declares none)."""

    @abstractmethod
    def publish(self, actor: Actor, engine: RolloutEngine, version: int) -> tuple[list[Receipt], str]:
        """Push the actor's weights as ``version``; return the receipts and the sender's fingerprint."""
