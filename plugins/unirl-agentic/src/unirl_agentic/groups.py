"""``PendingGroups``: siblings become a GRPO group only when all n are terminal.

Trajectories of one launch finish at different times (turn counts differ, a weight sync interrupts
some). A group handed to the estimator early would be scored against a partial baseline, so siblings
wait here, keyed by ``group_id`` (which carries the launch tag: two launches of one prompt never merge).
A failed sibling (reward NaN) still counts as terminal: the estimator excludes it from the statistics.
With ``rollout.branching`` a trajectory that forks into n branches is replaced by them: its group
waits for n - 1 more (:meth:`PendingGroups.grow`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from unirl.api import Sample


@dataclass
class _Group:
    n: int
    seq: int
    done: dict[str, Sample] = field(default_factory=dict)


class PendingGroups:
    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}
        self._seq = 0

    def open(self, group_id: str, n: int) -> None:
        if group_id in self._groups:
            raise ValueError(f"group {group_id} is already pending: launch tags must be unique per drive")
        self._groups[group_id] = _Group(n=n, seq=self._seq)
        self._seq += 1

    def grow(self, group_id: str, k: int) -> None:
        """``k`` more members: one trajectory of the group forked into ``k + 1`` branches."""
        self._groups[group_id].n += k

    def add(self, sample: Sample) -> list[Sample] | None:
        """Record a terminal sibling; return the whole group (sibling order) when it was the last."""
        g = self._groups.get(sample.group_id)
        if g is None:
            raise ValueError(f"sample {sample.id}: its group {sample.group_id} is not pending")
        if sample.id in g.done:
            raise ValueError(f"sample {sample.id} reached a terminal state twice")
        g.done[sample.id] = sample
        if len(g.done) < g.n:
            return None
        del self._groups[sample.group_id]
        return sorted(g.done.values(), key=_path_order)

    def discard(self, group_id: str) -> list[Sample]:
        """Forget a group (its tail was dropped); returns the siblings that had finished."""
        g = self._groups.pop(group_id, None)
        return list(g.done.values()) if g else []

    def items(self) -> list[tuple[str, int, list[Sample]]]:
        """``(group_id, n, finished siblings)`` of every pending group, in the order they were opened."""
        return [(gid, g.n, list(g.done.values())) for gid, g in sorted(self._groups.items(), key=lambda kv: kv[1].seq)]

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)


def _path_order(sample: Sample) -> list[tuple[int, ...]]:
    """Sibling order: the path after the launch, numerically (``p@t/1`` < ``p@t/1/f2.0`` < ``p@t/2``)."""
    return [tuple(int(x) for x in re.findall(r"\d+", c)) for c in sample.id.split("/")[1:]]
