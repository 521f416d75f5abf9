"""VersionedBuffer: finished rollout groups, each stamped with the weight version it was launched under.

Why a buffer with versions: in async mode the trainer consumes groups the engine generated under older
weights. How old is bounded by ``rollout.max_staleness`` (in published versions), and the bound is
enforced here, at the one place groups are handed to the trainer, so no code path can train on a group
older than the bound. A drain is all-or-nothing (``n`` whole groups or none, nothing consumed), so a
batch never holds a partial group and a short drain leaves everything for the next one.
"""

from __future__ import annotations

from dataclasses import dataclass

from unirl.kernel.errors import UniRLError
from unirl.samples import Sample


class StaleVersionError(UniRLError):
    """A group claims a weight version that was never published (a bookkeeping bug, never data)."""


@dataclass
class BufferedGroup:
    """One GRPO group (every sample of one launch of one prompt), whole."""

    group_id: str
    samples: list[Sample]
    version: int  # the weight version the launch was stamped with
    gen_id: int  # the launch it came from (ties between equal versions go oldest launch first)

    def staleness(self, current_version: int) -> int:
        return current_version - self.version


class VersionedBuffer:
    """Whole groups waiting to be trained on, freshest first; the staleness bound is applied on drain."""

    def __init__(self) -> None:
        self._groups: list[BufferedGroup] = []
        self._ids: set[str] = set()
        self._evicted: list[BufferedGroup] = []
        self.version = 0  # the newest version this buffer knows was published

    def __len__(self) -> int:
        return len(self._groups)

    def observe(self, version: int) -> None:
        """Record that ``version`` is now published (a put above it is then no longer from the future)."""
        if version < self.version:
            raise StaleVersionError(f"published version went back from {self.version} to {version}")
        self.version = version

    def put(self, group: list[Sample], weight_version: int, gen_id: int) -> None:
        """Add one whole group. Rejects a version from the future and a group already held."""
        self.put_all([group], weight_version, gen_id)

    def put_all(self, groups: list[list[Sample]], weight_version: int, gen_id: int) -> None:
        """Add the groups of one launch, all or none: every check runs before the first insert, so a
        rejected launch leaves the buffer as it was (and a retry cannot half-insert it)."""
        seen: set[str] = set()
        for group in groups:
            self._check(group, weight_version)
            if group[0].group_id in seen:
                raise ValueError(f"group {group[0].group_id} appears twice in one put")
            seen.add(group[0].group_id)
        for group in groups:
            gid = group[0].group_id
            self._ids.add(gid)
            self._groups.append(BufferedGroup(gid, list(group), int(weight_version), int(gen_id)))

    def _check(self, group: list[Sample], weight_version: int) -> None:
        if not group:
            raise ValueError("VersionedBuffer.put: an empty group")
        gid = group[0].group_id
        if any(s.group_id != gid for s in group):
            raise ValueError(f"VersionedBuffer.put: samples of more than one group ({gid}, ...)")
        if weight_version > self.version:
            raise StaleVersionError(
                f"group {gid} is stamped with weight version {weight_version}, but only {self.version} has "
                "been published: a version from the future (the stamp must be taken at launch)")
        if gid in self._ids:
            raise ValueError(f"group {gid} is already in the buffer (a double insert)")

    def drain_freshest(self, n: int, current_version: int, max_staleness: int) -> list[BufferedGroup]:
        """Evict groups staler than ``max_staleness``, then return the ``n`` freshest, or ``[]`` without
        consuming anything when fewer than ``n`` are left.

        Freshest = highest version; equal versions go oldest launch first (FIFO), then by group id, so the
        order is deterministic."""
        self.observe(current_version)
        keep, evict = [], []
        for g in self._groups:
            (evict if g.staleness(current_version) > max_staleness else keep).append(g)
        self._groups = keep
        for g in evict:
            self._ids.discard(g.group_id)
        self._evicted.extend(evict)
        if len(keep) < n:
            return []
        ranked = sorted(keep, key=lambda g: (-g.version, g.gen_id, g.group_id))
        out = ranked[:n]
        taken = {g.group_id for g in out}
        self._groups = [g for g in keep if g.group_id not in taken]
        self._ids -= taken
        return out

    def take_evicted(self) -> list[BufferedGroup]:
        """The groups evicted since the last call (for metrics), handed out once."""
        out, self._evicted = self._evicted, []
        return out

    def clear(self) -> list[BufferedGroup]:
        """Drop everything (a checkpoint restart discards unconsumed groups); return what was dropped."""
        out, self._groups, self._ids = self._groups, [], set()
        return out
