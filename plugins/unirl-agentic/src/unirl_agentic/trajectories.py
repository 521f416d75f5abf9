"""The agentic controller's trajectory bookkeeping, apart from its policy.

:class:`TrajectoryPool` knows which trajectories are live, on which worker each runs its environment, and
which samples wait in the backlog for a slot. :class:`Submissions` knows the engine jobs in flight: each
handle, the samples it has not handed back yet, and what a blocking wait already polled. Why classes of
their own: :class:`~unirl_agentic.controller.AgenticRolloutController` decides when a trajectory turns,
forks, fails or is carried; these keep the containers consistent (a worker's load goes down exactly
once per trajectory, a submission leaves once all its samples came back), so the controller's code reads
as the policy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from unirl.api import Handle, Sample


@dataclass
class Trajectory:
    """One live trajectory: its sample, its worker, and where it is in its turn."""

    sample: Sample
    worker: int
    state: str = "ready"  # ready | generating | stepping
    mark: int = 0  # len(response_text) before the current turn
    snapshot: Sample | None = None  # the sample at the last turn boundary (rewind target)
    handle: int | None = None
    future: Future | None = None


class TrajectoryPool:
    """At most ``workers * per_worker`` live trajectories, at most ``per_worker`` on each worker; the rest
    wait in :attr:`backlog` (its front is admitted first: forked branches go there)."""

    def __init__(self, workers: int, per_worker: int) -> None:
        self.per_worker = per_worker
        self.cap = workers * per_worker
        self.load = [0] * workers
        self.active: dict[str, Trajectory] = {}
        self.backlog: deque[Sample] = deque()

    def admit(self) -> Trajectory | None:
        """The next backlog sample as a live trajectory on the least-loaded worker; None when the backlog
        is empty, the pool is full or that worker is full (the sample stays at the front)."""
        if not self.backlog or len(self.active) >= self.cap:
            return None
        s = self.backlog.popleft()
        w = min(range(len(self.load)), key=lambda i: (self.load[i], i))
        if self.load[w] >= self.per_worker:
            self.backlog.appendleft(s)
            return None
        self.load[w] += 1
        t = self.active[s.id] = Trajectory(s, w)
        return t

    def release(self, t: Trajectory) -> bool:
        """Take ``t`` out of the pool and free its worker slot; False if it had left already, so its
        environment is closed exactly once."""
        if self.active.pop(t.sample.id, None) is None:
            return False
        self.load[t.worker] -= 1
        return True

    def get(self, sample_id: str) -> Trajectory | None:
        return self.active.get(sample_id)

    def live(self) -> list[Trajectory]:
        """The live trajectories, as a list (the caller may release some while it iterates)."""
        return list(self.active.values())

    def samples(self) -> list[Sample]:
        """Every sample not finished: the live trajectories' and the backlog's."""
        return [t.sample for t in self.active.values()] + list(self.backlog)

    def group_ids(self) -> set[str]:
        return {t.sample.group_id for t in self.active.values()} | {s.group_id for s in self.backlog}

    def __len__(self) -> int:
        """Live and waiting trajectories."""
        return len(self.active) + len(self.backlog)


class Submissions:
    """The engine jobs in flight, by handle id: the handle, the ids of its samples not handed back yet,
    and what a blocking wait polled (kept for the next reap, so nothing polled is lost)."""

    def __init__(self) -> None:
        self.handles: dict[int, Handle] = {}
        self._left: dict[int, set[str]] = {}
        self._kept: dict[int, Any] = {}

    def add(self, h: Handle) -> None:
        self.handles[h.id] = h
        self._left[h.id] = set(h.sample_ids)

    def items(self) -> list[tuple[int, Handle]]:
        """The jobs, oldest first, as a list (the caller may drop some while it iterates)."""
        return list(self.handles.items())

    def inflight(self) -> int:
        """Samples submitted and not handed back (the engine-side room is ``max_inflight_requests`` less this)."""
        return sum(len(h.sample_ids) for h in self.handles.values())

    def returned(self, hid: int, ids: Iterable[str]) -> None:
        """Samples ``ids`` of job ``hid`` came back; the job leaves once all of its samples did."""
        left = self._left[hid]
        left.difference_update(ids)
        if not left:
            del self.handles[hid], self._left[hid]

    def drop(self, hid: int) -> None:
        """Job ``hid`` ended as a whole (failed or aborted)."""
        del self.handles[hid]
        self._left.pop(hid, None)

    def keep(self, hid: int, polled: Any) -> None:
        """What a blocking wait polled for job ``hid`` (its samples, or the error it raised)."""
        self._kept[hid] = polled

    def kept(self, hid: int) -> bool:
        return hid in self._kept

    def take(self, hid: int) -> Any:
        """What was kept for job ``hid`` (None if nothing), forgotten."""
        return self._kept.pop(hid, None)

    def clear(self) -> None:
        self.handles.clear()
        self._left.clear()
        self._kept.clear()

    def __bool__(self) -> bool:
        return bool(self.handles)
