"""In-process weight sync: the actor and the engine live in one process, tensors are handed over directly.

``publish`` takes the actor's full weights in HF names (:meth:`Actor.named_weights`), renames them for
the engine (:meth:`ModelAdapter.engine_weight_name`), fingerprints exactly that ordered list with
:func:`unirl.contracts.fingerprint` (the sender's manifest) and hands it to ``engine.load_weights``.
The engine copies the values into its own tensors (it never aliases the actor's) and returns receipts
with the fingerprint of what it received. The trainer then calls ``VersionLedger.commit(version,
receipts, manifest)``, which refuses (and does not advance the version) unless every receipt agrees.

The list holds references to the actor's live tensors, not copies: no extra memory on one device, and
the engine must have finished copying before the next optimizer step (``load_weights`` is synchronous).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unirl.contracts import Actor, Receipt, RolloutEngine, WeightSync, fingerprint

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.config import RunConfig


class InProcessSync(WeightSync):
    """``weight_sync.name: inprocess`` (no options)."""

    def __init__(self, *, config: RunConfig, **_: Any) -> None:
        self.config = config
        if config.weight_sync.options:
            from unirl.kernel.errors import ConfigError

            raise ConfigError(
                f"weight_sync 'inprocess' takes no options, got {sorted(config.weight_sync.options)}"
            )

    def manifest(self, actor: Actor) -> list[tuple[str, torch.Tensor]]:
        """The ordered ``(engine name, tensor)`` list that one publish sends."""
        adapter = getattr(actor, "adapter", None)
        engine_name = self.config.rollout.engine
        out: list[tuple[str, torch.Tensor]] = []
        for name, t in actor.named_weights():
            if adapter is not None:
                name = adapter.engine_weight_name(name, engine_name)
            out.append((name, t.detach()))
        return out

    def publish(self, actor: Actor, engine: RolloutEngine, version: int) -> tuple[list[Receipt], str]:
        named = self.manifest(actor)
        manifest_fingerprint = fingerprint(named)
        receipts = engine.load_weights(iter(named), version)
        return list(receipts), manifest_fingerprint
