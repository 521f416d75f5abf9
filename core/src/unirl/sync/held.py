"""What an engine already holds, so a weight sync sends only what can have changed (issue 71).

Why: a frozen vision tower (``actor.freeze: [vision]``) is a large part of a vision-language model that
never moves, yet every sync re-sent it. An actor declares the weights it never changes
(:meth:`unirl.contracts.Actor.frozen_weights`); once an engine has received a complete sync from that
actor, later syncs to the same engine leave those weights out and declare them kept
(:meth:`unirl.weights.Staged.leave_out`), so the completeness checks on both ends still hold.

The first sync to an engine object is always complete. That covers a fresh engine, a resumed run (the
engine starts from the build checkpoint, the actor from a run checkpoint) and a rebuilt engine (a new
object): each gets every weight once, whatever it started from. Only a later sync from the same actor
skips.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Iterable, Iterator
from typing import TYPE_CHECKING

from unirl.contracts import Actor

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.contracts import RolloutEngine


class HeldWeights:
    """Per engine, the actor whose complete weights it received (weakly held: a closed engine drops out)."""

    def __init__(self) -> None:
        self._full: weakref.WeakKeyDictionary[RolloutEngine, int] = weakref.WeakKeyDictionary()

    def unchanged(self, actor: Actor, engine: RolloutEngine) -> dict[str, tuple[int, ...]]:
        """The actor weights this sync may leave out (name -> full shape): none before a complete sync."""
        if self._full.get(engine) != id(actor) or not isinstance(actor, Actor):
            return {}  # a bare weight source (a benchmark's or test's named_weights) declares nothing frozen
        return dict(actor.frozen_weights())

    def received(self, actor: Actor, engine: RolloutEngine) -> None:
        """``engine`` loaded a sync from ``actor``: it now holds every weight the actor never changes."""
        self._full[engine] = id(actor)


def without(named: Iterable[tuple[str, torch.Tensor]], skip: Collection[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` (``(name, tensor)`` pairs) less the names in ``skip``."""
    return ((n, t) for n, t in named if n not in skip)


__all__ = ["HeldWeights", "without"]
