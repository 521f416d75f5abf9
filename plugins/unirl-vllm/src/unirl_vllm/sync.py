"""The ``vllm`` weight sync: the actor's weights streamed into a ``VLLMEngine`` bucket by bucket.

``publish`` casts the actor's ``named_weights()`` stream to the engine's dtype and hands it to
:meth:`unirl_vllm.engine.VLLMEngine.load_stream`, which renames each tensor through the model adapter,
checks it (:mod:`unirl.weights`), fingerprints it and loads it into every replica in one reload session,
``rollout.options.bucket_mb`` at a time (:mod:`unirl_vllm.stream`). Nothing holds the whole set: the
trainer's process needs a few buckets for a sync, not a copy of the model (core's
:class:`unirl.sync.inprocess.InProcessSync` stages the whole set first). The returned fingerprint is the
sender's, of exactly what was sent, in order; every worker's receipt must equal it. For Ray placements
the engine picks the carrier per replica by where it is (:mod:`unirl.sync.transport`) and names it in
each receipt. Weights the actor never changes (a frozen vision tower) go in the first sync to an engine
only, as in core's sync (:mod:`unirl.sync.held`); later syncs declare them kept, and each vLLM worker
leaves those layers as they are. With ``actor.lora.sync: adapter`` the adapter alone is published, as core's sync does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from unirl.api import Actor, ConfigError, InProcessSync, Receipt, RolloutEngine

if TYPE_CHECKING:  # pragma: no cover
    import torch


class VLLMWeightSync(InProcessSync):
    """``weight_sync.name: vllm`` (no options): publishes an actor's weights into a ``VLLMEngine``."""

    def publish(self, actor: Actor, engine: RolloutEngine, version: int) -> tuple[list[Receipt], str]:
        from unirl_vllm.engine import VLLMEngine

        lora = self.config.actor.lora
        if lora is not None and lora.sync == "adapter":
            return self._publish_adapter(actor, engine, version)
        if not isinstance(engine, VLLMEngine):
            raise ConfigError(f"weight_sync 'vllm' loads into the 'vllm' engine, not {type(engine).__name__} "
                              "(set rollout.engine: vllm)")
        import torch

        dtype = getattr(torch, engine.spec.dtype.removeprefix("torch."))

        def cast(named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named:
                yield name, tensor.detach().to(dtype)

        unchanged = self.held.unchanged(actor, engine)  # frozen weights every replica holds already
        changed = ((n, t) for n, t in actor.named_weights() if n not in unchanged)
        receipts, sent = engine.load_stream(cast(changed), version, unchanged=unchanged)
        self.held.received(actor, engine)
        return list(receipts), sent


__all__ = ["VLLMWeightSync"]
