"""The ``vllm`` weight sync: core's in-process sync under the name the ``vllm`` engine declares.

The transport is :class:`unirl.sync.inprocess.InProcessSync`: the actor's ``named_weights()`` stream
is cast to the engine's dtype, renamed by the model adapter, checked and staged through
``engine.stage()`` (:mod:`unirl.weights`), and fingerprinted on the way; ``engine.load_weights`` then
loads the staged set in one session and returns one receipt per worker of every replica. For Ray
placements the engine picks the carrier per replica by where it is (:mod:`unirl.sync.transport`:
tmpfs files on the trainer's node, Ray's object store elsewhere) and names it in each receipt. No logic of its own lives here:
the name is kept so recipes that say ``weight_sync.name: vllm`` keep working.
"""

from __future__ import annotations

from unirl.api import InProcessSync


class VLLMWeightSync(InProcessSync):
    """``weight_sync.name: vllm`` (no options): publishes an actor's weights into a ``VLLMEngine``."""


__all__ = ["VLLMWeightSync"]
