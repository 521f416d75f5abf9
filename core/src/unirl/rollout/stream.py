"""The streaming rollout mechanism (``rollout.mode: stream``): the engine never drains between steps.

Why: a collect of a whole batch waits for its longest answer, so the engine idles at the end of every
step (the long tail). Here each group is its own launch (``collect(groups=1)`` of the trainer's
controller (``groups=rollout.stream.groups_per_launch``), on a pool of ``slots`` threads); a finished group is scored by its controller, stamped
with the version of its oldest model token, and put in a buffer, and a new launch takes its slot at
once. The trainer takes whole groups from the buffer, oldest first, and launching stops at
:func:`held_ceiling`, so no group is generated to be evicted. The policy (how many groups a
step takes, when weights move) is the driver's (:mod:`unirl.trainer.stream_driver`).

Invariants (tested in ``core/tests/test_stream_rollout.py``):

* **complete or nothing**: a launch enters the buffer whole, as its controller returned it, or not at
  all (its collect raised); the trainer takes whole groups;
* **once**: a launch id enters the buffer at most once (a second insert is a bug, and raises);
* **the staleness bound**: a group older than ``max_staleness`` versions (ledger version minus its
  oldest model token's version) is evicted, counted, never trained on. ``max_staleness: 0`` trains only
  groups generated wholly under the served weights;
* **errors after accounting**: the first launch error stops new launches and is raised once every
  launch in flight has ended (none is left running behind the error);
* **stalls**: no progress (no launch ended, no decode step: :mod:`unirl.rollout.stall`) for
  ``stall_timeout_s`` while launches run raises :class:`EngineStalledError` (restartable) naming the
  engine, the launches and the requests in flight;
* **sync**: :meth:`StreamingController.sync_weights` pauses the engine, waits until no request runs
  (a running one ends under the weights it started with), publishes, resumes; queued requests keep
  their place and start under the new weights (an engine declares this: ``requests_across_sync``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from unirl.contracts import (
    Actor,
    Receipt,
    RolloutController,
    RolloutEngine,
    SamplingParams,
    VersionLedger,
    WeightSync,
)
from unirl.rollout.controller import OnPublished, publish_next
from unirl.rollout.stall import EngineStalledError, last_progress, stall_error  # noqa: F401 - the error, re-exported
from unirl.samples import NO_VERSION, Sample, now_ms


@dataclass
class Group:
    """One finished launch in the buffer: its samples (one prompt's group, scored), the version of its
    oldest model token, and when it finished (wall time)."""

    launch: int
    samples: list[Sample]
    min_version: int
    finished_at: float


def oldest_version(samples: list[Sample], default: int) -> int:
    """The version of the oldest model token of ``samples`` (``default`` when none carries one)."""
    versions = [v for s in samples for v, m in zip(s.versions, s.loss_mask, strict=False) if m and v != NO_VERSION]
    return min(versions, default=default)


#: ``collect_group(launch_tag) -> samples``: one group, scored, by the trainer's controller
CollectGroup = Callable[[str], list[Sample]]


def held_ceiling(*, per_take: int, max_staleness: int, interval: int, takes_this_version: int) -> int:
    """The most groups that may be held (buffered + running) now, so that none is generated to be evicted.

    Derivation. A group launched now has its oldest token at version >= ``v``, the version the ledger holds
    now. It may be trained while the ledger holds ``v .. v + max_staleness``: ``(max_staleness + 1) *
    interval`` takes (weights move once every ``interval`` takes), of which ``takes_this_version`` already
    happened at ``v``. Takes are oldest first (:meth:`StreamingController.take`), so every group held
    before it is taken before it, and each take removes ``per_take``: it is trained in time iff at most
    ``per_take`` x the takes left are held, itself included. Before a take at least one take is left
    (``takes_this_version < interval``), so the ceiling is never below the take's own ``per_take``.
    ``max_staleness: 0`` gives 0 between a version's last take and the sync: nothing launches while the
    trainer trains on it (on-policy, as sync mode). Same idea as :func:`unirl.rollout.controller.launch_ceiling`,
    counted in groups instead of whole collects."""
    return per_take * max(0, (max_staleness + 1) * interval - takes_this_version)


class StreamingController(RolloutController):
    """Keeps ``slots`` one-group launches of the trainer's controller running, buffers what finishes,
    and hands whole groups to the trainer (:meth:`take`). See the module doc for the invariants.

    It wraps the trainer's controller and is one itself (checkpoints save through it: :meth:`state_dict`
    stores the buffer after :meth:`quiesce` drained the launches, so a resumed run trains each group once).
    """

    def __init__(self, inner: RolloutController, engine: RolloutEngine, ledger: VersionLedger, *,
                 collect_group: CollectGroup, slots: int, max_staleness: int, stall_timeout_s: float,
                 engine_name: str, buffer_cap: int, on_published: OnPublished | None = None,
                 on_sync: str = "continue", take_size: int | None = None, sync_interval: int = 1,
                 groups_per_launch: int = 1) -> None:
        if slots < 1 or max_staleness < 0 or stall_timeout_s <= 0:
            raise ValueError("slots >= 1, max_staleness >= 0 and stall_timeout_s > 0 are required")
        self.inner, self.engine, self.ledger, self.on_sync = inner, engine, ledger, on_sync
        self.collect_group, self.slots, self.max_staleness = collect_group, slots, max_staleness
        self.buffer_cap = max(1, buffer_cap)  # finished groups held before launching pauses
        # take_size: the trainer's groups per take; set, launching also stops at held_ceiling (the driver's policy)
        self.take_size, self.sync_interval, self.groups_per_launch = take_size, sync_interval, groups_per_launch
        self._takes = (ledger.version, 0)  # (ledger version, takes done under it): held_ceiling's clock
        self._want = 0  # groups the current take waits for (the buffer may always grow that far)
        self.stall_timeout_s, self.engine_name, self._on_published = stall_timeout_s, engine_name, on_published
        self._cv = threading.Condition()
        self._pool = ThreadPoolExecutor(slots, thread_name_prefix="rollout-stream")
        self._running: dict[int, float] = {}  # launch id -> wall time it started
        self._buffer: list[Group] = []
        self._inserted: set[tuple[int, str]] = set()  # (launch, group id) of every group buffered
        self._next = 0
        self._open = self._dry = self._stalled = False
        self._error: BaseException | None = None
        self._progress = time.monotonic()
        self.evicted_total, self.evicted_launches = 0, []  # launch ids evicted (the last few hundred)
        self._acc = {"evicted": 0, "pause_s": 0.0, "occ_area": 0.0, "occ_t0": time.monotonic()}
        self._occ_last = time.monotonic()
        self._busy0 = self._busy_s()  # the engine's request-seconds decoding at the last step_metrics

    # ------------------------------------------------------------------ launching (the pool)
    def _tick(self) -> None:  # caller holds _cv: the in-flight integral for the occupancy metric
        now = time.monotonic()
        self._acc["occ_area"] += len(self._running) * (now - self._occ_last)
        self._occ_last = now

    def _busy_s(self) -> float:  # the engine's request-seconds decoding so far (-1: it cannot say)
        report = self.engine.progress()
        return report.busy_s if report is not None else -1.0

    def _cap(self) -> int:  # caller holds _cv: groups that may be held now
        if self.take_size is None:
            return self.buffer_cap
        v, done = self._takes
        return min(self.buffer_cap, held_ceiling(
            per_take=self.take_size, max_staleness=self.max_staleness, interval=self.sync_interval,
            takes_this_version=done if v == self.ledger.version else 0))

    def _fill(self) -> None:  # caller holds _cv
        # backpressure: no group generated only to be evicted, so running launches count (a merging engine
        # finishes many at once, and the buffer alone overshot to twice the cap)
        while (self._open and self._error is None and not self._dry and len(self._running) < self.slots
               and len(self._buffer) + len(self._running) * self.groups_per_launch < max(self._cap(), self._want)):
            k, self._next = self._next, self._next + 1
            self._tick()
            self._running[k] = time.time()
            self._pool.submit(self._run_one, k, self.engine.weight_version)

    def _run_one(self, k: int, launched_under: int) -> None:
        samples: list[Sample] | None = None
        error: BaseException | None = None
        try:
            samples = self.collect_group(f"stream-{k}")
        except BaseException as exc:  # noqa: BLE001 - raised to the trainer once every launch is accounted for
            error = exc
        with self._cv:
            self._tick()
            self._running.pop(k, None)
            self._progress = time.monotonic()
            if error is not None:
                self._error = self._error or error
            elif not samples:
                self._dry = True  # the cursor ran dry: launch nothing more
            else:  # a launch of several prompts: one buffer entry per group (Sample.group_id), all at once
                groups: dict[str, list[Sample]] = {}
                for smp in samples:
                    groups.setdefault(smp.group_id, []).append(smp)
                for members in groups.values():
                    self._insert(Group(k, members, oldest_version(members, launched_under), time.time()))
            self._fill()
            self._cv.notify_all()

    def _insert(self, group: Group) -> None:
        key = (group.launch, group.samples[0].group_id)
        if key in self._inserted:
            raise RuntimeError(f"group {key[1]} of launch stream-{group.launch} entered the buffer twice")
        self._inserted.add(key)
        self._buffer.append(group)

    def _evict(self) -> None:  # caller holds _cv
        keep = []
        for g in self._buffer:
            if self.ledger.version - g.min_version > self.max_staleness:
                self.evicted_total += 1
                self._acc["evicted"] += 1
                self.evicted_launches = (self.evicted_launches + [g.launch])[-512:]
            else:
                keep.append(g)
        self._buffer = keep

    def _check_stall(self, force: bool = False) -> None:  # caller holds _cv
        """Progress: a launch ended, or the engine stepped (:func:`unirl.rollout.stall.last_progress`)."""
        if force or (self._running and time.monotonic() - last_progress(self.engine, self._progress)
                     > self.stall_timeout_s):
            self._stalled, self._open = True, False
            raise stall_error(self.engine, self.engine_name, self.stall_timeout_s,
                              [f"stream-{k}" for k in sorted(self._running)])

    def _wait(self, done: Callable[[], bool]) -> None:  # caller holds _cv; raises on a stall
        while not done():
            self._check_stall()
            self._cv.wait(timeout=min(0.5, self.stall_timeout_s))

    def _raise_error(self) -> None:  # caller holds _cv: the first error, once nothing runs
        if self._error is None:
            return
        self._open = False
        self._wait(lambda: not self._running)
        error, self._error = self._error, None
        raise error

    # ------------------------------------------------------------------ the trainer's side
    def take(self, groups: int) -> list[Group]:
        """``groups`` whole groups within the staleness bound, oldest first (oldest oldest-token version,
        then the earliest launch: the groups nearest eviction go first, so, under :func:`held_ceiling`,
        none is left to expire; freshest first evicted a third of a long-tail run's groups); waits for
        them, launching as slots free. Each sample gets ``meta["staleness"]``."""
        with self._cv:
            self._want = groups
            if not self._open:
                self._open, self._progress = True, time.monotonic()
                self._fill()
            while True:
                self._evict()
                self._raise_error()
                self._fill()  # evictions made room (launching pauses while the buffer is full)
                if len(self._buffer) >= groups or (self._dry and not self._running and self._buffer):
                    break
                if self._dry and not self._running:
                    raise RuntimeError("the prompt cursor ran dry and no group is buffered")
                self._check_stall()
                self._cv.wait(timeout=min(0.5, self.stall_timeout_s))
            self._buffer.sort(key=lambda g: (g.min_version, g.launch))
            taken, self._buffer = self._buffer[:groups], self._buffer[groups:]
            v, done = self._takes
            self._takes, self._want = (self.ledger.version, (done if v == self.ledger.version else 0) + 1), 0
            self._fill()  # room in the buffer again
        for g in taken:
            for s in g.samples:
                s.meta["staleness"] = self.ledger.version - g.min_version
                s.meta["min_version"] = g.min_version
        return taken

    @property
    def in_flight(self) -> int:
        with self._cv:
            return len(self._running)

    @property
    def buffer_depth(self) -> int:
        with self._cv:
            return len(self._buffer)

    def quiesce(self) -> float:
        """Launch nothing more and wait until every running launch is in the buffer (or failed: raised by
        the next :meth:`take`); the next :meth:`take` starts launching again. Returns seconds waited."""
        t0 = time.perf_counter()
        with self._cv:
            self._open = False
            if not self._stalled:
                self._wait(lambda: not self._running)
        return time.perf_counter() - t0

    def sync_weights(self, transport: WeightSync, actor: Actor) -> tuple[int, list[Receipt]]:
        """Pause the engine, wait until no request runs, publish the next version, resume (the pause time
        goes into the step's metrics). Queued requests start afterwards, under the new weights."""
        t0, paused_ms = time.perf_counter(), now_ms()
        self.engine.pause()
        try:
            if self.on_sync == "abort":  # rollout.stream.on_sync: the running requests start over after the load
                self._acc["restarted"] = self._acc.get("restarted", 0) + len(self.engine.restart_running())
            if not self.engine.wait_running(self.stall_timeout_s):
                with self._cv:
                    self._check_stall(force=True)  # the pause never took effect: a stall
            out = publish_next(self.ledger, transport, actor, self.engine, self._on_published, paused_at_ms=paused_ms)
        finally:
            self.engine.resume()
        with self._cv:
            self._acc["pause_s"] += time.perf_counter() - t0
            self._evict()  # what the new version made too old goes now (counted in this step)
            self._fill()  # a new version: held_ceiling rose
        return out

    def step_metrics(self, requests_per_launch: int, inflight: int) -> dict[str, float]:
        """Since the last call: engine occupancy (mean requests in flight / ``inflight``), the share actually
        decoding (``stream/decoding``: the engine's request-seconds decoding / ``inflight`` / wall time; -1
        when the engine cannot say; held requests may only be queued), groups evicted, sync pause seconds;
        now: buffer depth, launches running, evictions so far."""
        with self._cv:
            self._tick()
            now = time.monotonic()
            span = now - self._acc["occ_t0"]
            occ = self._acc["occ_area"] * requests_per_launch / inflight / span if span > 0 else 0.0
            busy, busy0 = self._busy_s(), self._busy0
            self._busy0 = busy
            dec = (busy - busy0) / inflight / span if span > 0 and busy >= 0 and busy0 >= 0 else -1.0
            out = {"stream/restarted_requests": float(self._acc.get("restarted", 0)), "stream/occupancy": occ,
                   "stream/decoding": dec, "stream/evicted_groups": float(self._acc["evicted"]),
                   "stream/evicted_total": float(self.evicted_total), "stream/sync_pause_s": self._acc["pause_s"],
                   "stream/buffer_depth": float(len(self._buffer)), "inflight_launches": float(len(self._running))}
            self._acc = {"evicted": 0, "pause_s": 0.0, "occ_area": 0.0, "occ_t0": now}
        return out

    # ------------------------------------------------------------------ RolloutController
    def collect(self, draw: Callable[[int], list[Sample]], *, groups: int, n: int,
                sampling: SamplingParams, launch_tag: str) -> list[Sample]:
        """A blocking collect of the inner controller (only while no launch runs)."""
        if self.in_flight:
            raise RuntimeError("collect() while stream launches run; quiesce() first")
        return self.inner.collect(draw, groups=groups, n=n, sampling=sampling, launch_tag=launch_tag)

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics()

    def warm_start_samples(self, prompts: list[Sample]) -> list[Sample]:
        return self.inner.warm_start_samples(prompts)

    def state_dict(self) -> dict[str, Any]:
        """The inner controller's state, the buffer (whole groups, their prompts already left the cursor)
        and the launch counter (ids stay unique after a resume). Only after :meth:`quiesce`: the loop
        drains before every checkpoint, so nothing is in flight and nothing is lost."""
        with self._cv:
            if self._running:
                raise RuntimeError(f"state_dict() with {len(self._running)} stream launch(es) running; quiesce() first")
            buffer = [(g.launch, g.samples, g.min_version) for g in self._buffer]
            return {"inner": self.inner.state_dict(),
                    "stream": {"next": self._next, "buffer": buffer, "evicted_total": self.evicted_total}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "stream" in state and "inner" in state:
            s = state["stream"]
            with self._cv:
                self._next, self.evicted_total = int(s["next"]), int(s["evicted_total"])
                for launch, samples, min_version in s["buffer"]:
                    self._insert(Group(int(launch), samples, int(min_version), time.time()))
            state = state["inner"]
        self.inner.load_state_dict(state)

    def close(self) -> None:
        """:meth:`stop`, then close the inner controller."""
        self.stop()
        self.inner.close()

    def stop(self) -> None:
        """Stop launching, let the running launches end (each is one group; a stalled engine is not waited
        on); the inner controller stays open (the stream driver owns this wrapper, the run's components
        the inner one). No abort: a blocking collect would wait for an aborted request."""
        with self._cv:
            self._open = False
            if not self._stalled:
                self._cv.wait_for(lambda: not self._running, timeout=self.stall_timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
