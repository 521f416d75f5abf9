"""The ``fsdp`` actor's declarations, without its implementation: ``actor.options`` (:class:`FSDPOptions`),
``capabilities`` and ``memory_layout``. :class:`unirl_fsdp.actor.FSDPActor` inherits them.

Why a module of its own: ``unirl plan`` reads only these, and the actor's module imports torch, the
ranks' worker and the training stack. The plugin registers this class as the actor's declaration
(``unirl_declarations``), so planning an FSDP run imports neither torch nor Ray.
"""

from __future__ import annotations

from unirl.api import Actor, ActorCapabilities, RunConfig
from unirl_fsdp.memory_layout import fsdp_layout
from unirl_fsdp.options import FSDPOptions


class FSDPDeclaration(Actor):
    """What the FSDP actor declares before it is built (never instantiated itself)."""

    Config = FSDPOptions
    memory_layout = classmethod(fsdp_layout)  # the memory plan's declaration (unirl_fsdp.memory_layout)

    @classmethod
    def capabilities(cls, config: RunConfig, options: FSDPOptions) -> ActorCapabilities:
        """``world_size`` ranks, each holding its shard; MixedPrecisionPolicy computes in ``compute_dtype``."""
        return ActorCapabilities(ranks=int(options.world_size), compute_dtype=options.compute_dtype,
                                 fields=(("ranks", "actor.options.world_size"),
                                         ("compute_dtype", "actor.options.compute_dtype")))
