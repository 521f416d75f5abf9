"""In-process weight sync: the actor and the engine live in one process, tensors are handed over directly.

``publish`` streams the actor's weights in HF names (:meth:`Actor.named_weights`) through the
engine's staging area (:meth:`RolloutEngine.stage`, :mod:`unirl.weights`): each tensor is cast to the
engine's serving dtype, renamed for the engine (the adapter's ``engine_weight_name``), checked and
copied, and folded into the sender's manifest fingerprint on the way (:func:`unirl.contracts.fingerprint`).
Weights the actor never changes (:meth:`Actor.frozen_weights`, e.g. a frozen vision tower) are sent
in the first sync to an engine only; later syncs declare them kept (:mod:`unirl.sync.held`).
Only a complete (less what is kept), valid staged set reaches ``engine.load_weights``, which returns one receipt per worker
with the fingerprint of what it loaded. The trainer then calls ``VersionLedger.commit(version,
receipts, manifest)``, which refuses (and does not advance the version) unless every receipt agrees.

With ``actor.lora.sync: adapter`` the sync publishes the LoRA adapter alone instead: the actor writes it
as a peft directory (:meth:`Actor.export_adapter`) into a temporary directory, the engine serves it on top
of its base weights (:meth:`RolloutEngine.load_adapter`), and the sender's fingerprint is
:func:`unirl.contracts.adapter_fingerprint` of that directory. Every version, the first included, goes
this way: the engine's base is the checkpoint the actor's base was built from (``model.path``, or
``model.build`` with ``run.seed``), and a merged first publish would fold a resumed run's adapter into
that base and apply it twice.

Every engine stages through the same module, so this transport serves any engine whose workers share
the trainer's memory (the embedded engine, vLLM in-process or behind a Ray host that receives staged
CPU tensors).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from unirl.contracts import Actor, Receipt, RolloutEngine, WeightSync, adapter_fingerprint, fingerprint
from unirl.sync.held import HeldWeights, without

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.config import RunConfig


class InProcessSync(WeightSync):
    """``weight_sync.name: inprocess`` (no ``Config``: the kernel refuses any ``weight_sync.options``)."""

    def __init__(self, *, config: RunConfig, options: None = None) -> None:
        self.config = config
        self.held = HeldWeights()  # what each engine holds already: frozen weights are sent once

    def publish(self, actor: Actor, engine: RolloutEngine, version: int) -> tuple[list[Receipt], str]:
        lora = self.config.actor.lora
        if lora is not None and lora.sync == "adapter":
            return self._publish_adapter(actor, engine, version)
        import torch

        staged = engine.stage()
        dtype = getattr(torch, staged.spec.dtype.removeprefix("torch."))
        unchanged = self.held.unchanged(actor, engine)
        staged.leave_out(unchanged)

        def cast(named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named:
                yield name, tensor.detach().to(dtype)

        # fingerprint() pulls the stream through the staging area: one pass, no second copy.
        staged.fingerprint = fingerprint(staged.tap(cast(without(actor.named_weights(), unchanged))))
        receipts = engine.load_weights(staged, version)
        self.held.received(actor, engine)
        return list(receipts), staged.fingerprint

    @staticmethod
    def _publish_adapter(actor: Actor, engine: RolloutEngine, version: int) -> tuple[list[Receipt], str]:
        """The adapter alone (``actor.lora.sync: adapter``): written by the actor, served by the engine."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="unirl-adapter-") as tmp:
            path = f"{tmp}/v{version}"
            actor.export_adapter(path)
            sent = adapter_fingerprint(path)
            receipts = engine.load_adapter(path, version)
        return list(receipts), sent
