"""BatchRolloutController: when a rollout may launch, how it is reaped, and the only way weights move.

It owns the three rules that make overlapped rollout safe, on top of the engine contract only
(``submit`` / ``poll`` / ``in_flight`` / ``weight_version``, no engine-specific code):

1. **launch-time stamps**: a launch is stamped with the version the engine serves *when it is
   submitted*; staleness is measured from that stamp, never from when the launch happened to finish;
2. **the launch ceiling** (:func:`launch_ceiling`, one formula for both controllers): launch ``g`` is the
   batch trained at step ``g``, and step ``g`` trains while the ledger holds
   ``version_at(g) = base + (g - first_gen) // weight_sync_interval``. A launch may start now only if it
   will be at most ``max_staleness`` versions old when consumed. With ``max_staleness=0`` nothing
   launches into a future sync window, so every batch is on-policy (PPO ratio 1 on its first update);
3. **quiesce before bump**: :meth:`sync_weights` refuses while anything is in flight (the engine would
   refuse too), then hands over to :func:`publish_next`, the one publish path of the project (the sync
   trainer calls it too), so the ledger advances only between launches.

The trainer's drivers decide when to call what (``unirl.trainer.drivers``: it is policy, so even the
refill of a starved batch is the driver's call, not this class's); eval and checkpoints call
:meth:`quiesce` first, and eval never pushes weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
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
from unirl.kernel.errors import SyncRefusedError
from unirl.rollout.buffer import BufferedGroup, VersionedBuffer
from unirl.rollout.pool import InflightPool, Launch
from unirl.samples import Sample, groups

#: ``build(gen_id) -> (samples, sampling)``: the trainer's recipe for launch ``gen_id``
Build = Callable[[int], tuple[list[Sample], SamplingParams]]


@dataclass
class Drained:
    """One batch handed to the trainer: whole groups, with what the metrics need."""

    groups: list[BufferedGroup]
    staleness: list[int]
    evicted: list[BufferedGroup] = field(default_factory=list)
    waited_s: float = 0.0  # trainer time spent waiting for it

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]


class BatchRolloutController:
    """Drives one engine for an async trainer (see the module docstring for the rules)."""

    def __init__(self, engine: RolloutEngine, ledger: VersionLedger, *, engine_name: str, max_staleness: int,
                 weight_sync_interval: int, first_gen: int = 0,
                 on_complete: Callable[[Launch], None] | None = None, on_published: OnPublished | None = None,
                 stall_timeout_s: float = 600.0) -> None:
        if max_staleness < 0 or weight_sync_interval < 1:
            raise ValueError("max_staleness must be >= 0 and weight_sync_interval >= 1")
        self.engine = engine
        self.ledger = ledger
        self.engine_name = engine_name
        self.max_staleness = max_staleness
        self.interval = weight_sync_interval
        self.first_gen = first_gen
        self.base_version = ledger.version  # the version step `first_gen` trains under
        self.next_gen = first_gen
        self.pool = InflightPool(engine, engine_name, stall_timeout_s=stall_timeout_s)
        self.buffer = VersionedBuffer()
        self.buffer.observe(ledger.version)
        self._on_complete = on_complete
        self._on_published = on_published
        self.busy: list[tuple[float, float]] = []  # (launched, finished) wall times of reaped launches

    # ------------------------------------------------------------------ launching
    def version_at(self, gen_id: int) -> int:
        """The ledger version while step ``gen_id`` trains (one sync every ``weight_sync_interval`` steps)."""
        return version_at(gen_id, first_gen=self.first_gen, base_version=self.base_version, interval=self.interval)

    def launch_ceiling(self) -> int:
        """The first gen id that may *not* launch now (:func:`launch_ceiling`)."""
        return launch_ceiling(self.ledger.version, first_gen=self.first_gen, base_version=self.base_version,
                              interval=self.interval, max_staleness=self.max_staleness)

    def launch_until(self, gen_id_limit: int, max_inflight: int, build: Build) -> int:
        """Launch gens ``next_gen .. min(gen_id_limit, launch_ceiling()) - 1`` while fewer than
        ``max_inflight`` launches are in flight; return how many were launched."""
        limit = min(gen_id_limit, self.launch_ceiling())
        launched = 0
        while self.next_gen < limit and self.pool.in_flight < max_inflight:
            self._launch(build)
            launched += 1
        return launched

    def _launch(self, build: Build) -> None:
        samples, sampling = build(self.next_gen)
        self.pool.launch(self.next_gen, samples, sampling, version=self.engine.weight_version)
        self.next_gen += 1

    # ------------------------------------------------------------------ reaping
    def _complete(self, launch: Launch) -> None:
        """Check the stamp, score (the trainer's handler), then put every group whole. The buffer refuses a
        double insert and a version from the future; a handler that raises leaves the launch pending, so a
        retry is exact. Tokens sampled under another version than the stamp mean the weights changed
        mid-flight (the sync guard failed): that is refused, never trained on."""
        served = {v for s in launch.samples for v, m in zip(s.versions, s.loss_mask, strict=True) if m}
        if served - {launch.version}:
            raise SyncRefusedError(
                f"rollout engine '{self.engine_name}': launch {launch.gen_id} was stamped version {launch.version} "
                f"but its tokens were sampled under {sorted(served)}: the weights changed mid-flight")
        if self._on_complete is not None:
            self._on_complete(launch)
        self.buffer.put_all(list(groups(launch.samples).values()), launch.version, launch.gen_id)
        self.busy.append((launch.launched_at, launch.finished_at or time.time()))

    def take(self, n_groups: int) -> tuple[list[BufferedGroup], list[BufferedGroup]]:
        """Reap what is back, then take ``n_groups`` whole groups within the staleness bound (freshest
        first; none when fewer are ready). Returns ``(taken, evicted)``: evicted groups grew too stale."""
        self.pool.reap(self._complete, timeout=0.0)
        got = self.buffer.drain_freshest(n_groups, self.ledger.version, self.max_staleness)
        return got, self.buffer.take_evicted()

    @property
    def idle(self) -> bool:
        """Nothing in flight on the engine and nothing back but unhandled: waiting would wait forever."""
        return not self.pool.in_flight and not self.pool.pending

    def wait(self, timeout: float) -> None:
        """Reap whatever finishes within ``timeout`` seconds into the buffer."""
        self.pool.reap(self._complete, timeout=timeout)

    def launch(self, build: Build) -> None:
        """Launch the next gen now, whatever the ceiling: for a driver whose batch cannot be filled
        otherwise (fresh data, at the current version, is never too stale)."""
        self._launch(build)

    def quiesce(self) -> float:
        """Wait until nothing is in flight (every launch reaped into the buffer); return the seconds waited."""
        t0 = time.perf_counter()
        self.pool.drain_all(self._complete)
        return time.perf_counter() - t0

    def abort(self) -> None:
        """End every launch now (error paths): the engine keeps nothing of ours in flight."""
        self.pool.abort_all()

    # ------------------------------------------------------------------ weights
    def sync_weights(self, transport: WeightSync, actor: Actor) -> tuple[int, list[Receipt]]:
        """Push the actor's weights as the next version and commit the ledger; the only way weights move.

        Refuses (``SyncRefusedError``, nothing pushed, the version unchanged) while any launch is in
        flight: :meth:`quiesce` first. Returns the new version and the workers' receipts."""
        busy = self.pool.in_flight or self.engine.in_flight
        if busy:
            raise SyncRefusedError(
                f"weight sync to version {self.ledger.version + 1} refused: {self.pool.in_flight} launch(es) "
                f"({self.engine.in_flight} samples) in flight on rollout engine '{self.engine_name}'; quiesce() first")
        version, receipts = publish_next(self.ledger, transport, actor, self.engine, self._on_published)
        self.buffer.observe(version)
        return version, receipts

    # ------------------------------------------------------------------ metrics
    def engine_idle_fraction(self, start: float, end: float) -> float:
        """The share of wall time ``[start, end]`` (``time.time()``) in which no launch was generating."""
        opened = [x.launched_at for x in self.pool.open_launches()]
        idle = idle_fraction(self.busy, opened, start, end)
        self.busy = [(a, b) for a, b in self.busy if b > start]
        return idle


def idle_fraction(busy: list[tuple[float, float]], open_since: list[float], start: float, end: float) -> float:
    """The share of ``[start, end]`` covered by none of the finished ``busy`` spans and none of the
    spans still open (started at ``open_since``, running to ``end``): the union of the spans, once."""
    span = end - start
    if span <= 0:
        return 0.0
    spans = [(max(a, start), min(b, end)) for a, b in busy if b > start and a < end]
    spans += [(max(t, start), end) for t in open_since]
    covered, cur = 0.0, None
    for a, b in sorted(spans):
        if cur is None or a > cur[1]:
            if cur is not None:
                covered += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    if cur is not None:
        covered += cur[1] - cur[0]
    return max(0.0, 1.0 - covered / span)


def version_at(gen_id: int, *, first_gen: int, base_version: int, interval: int) -> int:
    """The ledger version while step ``gen_id`` trains, when step ``first_gen`` trains under
    ``base_version`` and weights move once every ``interval`` steps."""
    return base_version + (gen_id - first_gen) // interval


def launch_ceiling(version: int, *, first_gen: int, base_version: int, interval: int, max_staleness: int) -> int:
    """The on-policy version window: the first gen id that may *not* launch while the ledger holds
    ``version``. Every launch below it is at most ``max_staleness`` versions old when its step trains:
    ``version_at(g) <= version + max_staleness``, solved for ``g``. The one formula of both controllers
    (the seed's contract: the window is policy, written once)."""
    return first_gen + (version - base_version + max_staleness + 1) * interval


#: ``on_published(version, receipts, lag_s)``: told once per committed version (the trainer fires the hook)
OnPublished = Callable[[int, list[Receipt], float], None]


def publish_next(ledger: VersionLedger, transport: WeightSync, actor: Actor, engine: RolloutEngine,
                 on_published: OnPublished | None = None) -> tuple[int, list[Receipt]]:
    """Publish the actor's weights to ``engine`` as the ledger's next version and commit it (the ledger
    checks the receipts), then tell ``on_published``. The one publish path: the sync trainer calls it
    directly, the controllers' :meth:`sync_weights` after their in-flight check."""
    t0 = time.perf_counter()
    version = ledger.version + 1
    receipts, manifest = transport.publish(actor, engine, version)
    ledger.commit(version, receipts, manifest)
    if on_published is not None:
        on_published(version, receipts, time.perf_counter() - t0)
    return version, receipts


#: ``collect() -> samples``: one step's ``RolloutController.collect`` (the trainer binds draw, groups, n, sampling)
Collect = Callable[[], list[Sample]]


class PrefetchingController(RolloutController):
    """``rollout.mode: async`` with ``rollout.controller``: the next step's :meth:`RolloutController.collect`
    runs on a background thread while the trainer trains on the current batch.

    The same three rules as :class:`BatchRolloutController`, for a controller that drives the engine
    itself (multi-turn trajectories, partial rollout):

    1. **stamps**: each collect is launched under the version the engine serves then; every trajectory
       it returns also carries its own ``meta["min_version"]`` (oldest model token, older for a carried
       tail), and at consumption :meth:`next_batch` stamps ``meta["staleness"]`` = ledger version minus
       that oldest token's version;
    2. **the launch ceiling**: collect ``g`` (the batch step ``g`` trains on) may start now only if
       ``version_at(g) <= ledger.version + max_staleness``; with ``max_staleness: 0`` nothing overlaps a
       sync, so the run is on-policy;
    3. **quiesce before bump**: :meth:`sync_weights` refuses while a collect runs (:meth:`quiesce` first).

    It wraps the trainer's controller and is one itself (``state_dict``, ``warm_start_samples`` and
    ``metrics`` delegate; :meth:`close` waits for the background collect before closing the inner one),
    so ``Components.close`` needs nothing new. Only one collect is in flight at a time: the controller
    owns its own over-generation, so one more drive in flight is all the overlap it needs.
    """

    def __init__(self, inner: RolloutController, engine: RolloutEngine, ledger: VersionLedger, *,
                 max_staleness: int, weight_sync_interval: int, first_gen: int = 0,
                 on_published: OnPublished | None = None) -> None:
        if max_staleness < 0 or weight_sync_interval < 1:
            raise ValueError("max_staleness must be >= 0 and weight_sync_interval >= 1")
        self.inner, self.engine, self.ledger = inner, engine, ledger
        self._on_published = on_published
        self.max_staleness, self.interval = max_staleness, weight_sync_interval
        self.first_gen = self.next_gen = first_gen
        self.base_version = ledger.version
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rollout-controller")
        self._future: Future | None = None
        self._launch: tuple[int, int, float] | None = None  # (gen, version, launched_at) of the future
        self._metrics: dict[str, float] = {}
        self._restored: dict[str, Any] | None = None  # a prefetched batch a checkpoint saved (state_dict)
        self.busy: list[tuple[float, float]] = []  # (launched, finished) wall times of finished collects

    # ------------------------------------------------------------------ launching
    def version_at(self, gen_id: int) -> int:
        return version_at(gen_id, first_gen=self.first_gen, base_version=self.base_version, interval=self.interval)

    def may_launch(self, gen_id: int) -> bool:
        """Collect ``gen_id`` is inside the on-policy window (:func:`launch_ceiling`)."""
        return gen_id < launch_ceiling(self.ledger.version, first_gen=self.first_gen, base_version=self.base_version,
                                       interval=self.interval, max_staleness=self.max_staleness)

    @property
    def in_flight(self) -> int:
        return int(self._future is not None and not self._future.done())

    def launch(self, gen_id: int, collect: Collect) -> bool:
        """Start collect ``gen_id`` in the background if nothing is pending and the ceiling allows it."""
        if self._future is not None or gen_id != self.next_gen or not self.may_launch(gen_id):
            return False
        self._launch = (gen_id, self.engine.weight_version, time.time())
        self._future = self._thread.submit(collect)
        self.next_gen += 1
        return True

    def next_batch(self, gen_id: int, collect: Collect) -> tuple[list[Sample], list[int], float, int]:
        """The batch of step ``gen_id``: the prefetched one, or collected now (fresh data is never too
        stale). Returns the samples (each stamped ``meta["staleness"]``), their staleness, the seconds
        the trainer waited, and the version the collect was launched under."""
        t0 = time.perf_counter()
        if self._future is None and self._restored is not None and self._restored["gen"] == gen_id:
            restored, self._restored = self._restored, None  # saved by a preemption's checkpoint
            self._launch = (gen_id, restored["version"], time.time())
            self._future = Future()
            self._future.set_result(restored["samples"])
            self.next_gen = gen_id + 1
        if self._future is None:
            if gen_id != self.next_gen:
                raise RuntimeError(f"step {gen_id}: the next collect is {self.next_gen}")
            self._launch = (gen_id, self.engine.weight_version, time.time())
            self._future = self._thread.submit(collect)
            self.next_gen += 1
        assert self._launch is not None
        gen, version, launched_at = self._launch
        if gen != gen_id:
            raise RuntimeError(f"step {gen_id}: the prefetched collect is step {gen}'s")
        try:
            samples = self._future.result()
        finally:
            self._future, self._launch = None, None
            self.busy.append((launched_at, time.time()))
        self._metrics = self.inner.metrics()
        staleness = []
        for s in samples:
            oldest = s.meta.get("min_version", version)
            s.meta["staleness"] = self.ledger.version - (version if oldest is None or oldest < 0 else oldest)
            staleness.append(s.meta["staleness"])
        return samples, staleness, time.perf_counter() - t0, version

    def quiesce(self) -> float:
        """Wait until the background collect (if any) is done; its batch stays ready. Returns seconds."""
        t0 = time.perf_counter()
        if self._future is not None:
            self._future.exception()  # waits; an error is raised to the trainer by next_batch
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ weights
    def sync_weights(self, transport: WeightSync, actor: Actor) -> tuple[int, list[Receipt]]:
        """Push the actor's weights as the next version; refused while a collect runs (quiesce first)."""
        if self.in_flight or self.engine.in_flight:
            raise SyncRefusedError(
                f"weight sync to version {self.ledger.version + 1} refused: a rollout-controller collect is "
                f"in flight ({self.engine.in_flight} samples on the engine); quiesce() first")
        return publish_next(self.ledger, transport, actor, self.engine, self._on_published)

    def engine_idle_fraction(self, start: float, end: float) -> float:
        """The share of wall time ``[start, end]`` in which no collect was running."""
        idle = idle_fraction(self.busy, [self._launch[2]] if self._launch is not None else [], start, end)
        self.busy = [(a, b) for a, b in self.busy if b > start]
        return idle

    # ------------------------------------------------------------------ RolloutController
    def collect(self, draw: Callable[[int], list[Sample]], *, groups: int, n: int,
                sampling: SamplingParams) -> list[Sample]:
        """A blocking collect (nothing prefetched may be pending: its batch would be skipped)."""
        if self._future is not None:
            raise RuntimeError("collect() while a prefetched batch is pending; take it with next_batch()")
        return self.inner.collect(draw, groups=groups, n=n, sampling=sampling)

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics) or self.inner.metrics()

    def warm_start_samples(self, prompts: list[Sample]) -> list[Sample]:
        return self.inner.warm_start_samples(prompts)

    def state_dict(self) -> dict[str, Any]:
        """The inner controller's state; with a collect already launched (a preemption's checkpoint: the
        trainer never prefetches across a scheduled one), also that batch, whole, once it is back: its
        prompts left the cursor, so without it a resume would skip them."""
        if self._future is None:
            return self.inner.state_dict()
        assert self._launch is not None
        gen, version, _ = self._launch
        samples = self._future.result()  # waits; the future stays, so this process could still train it
        return {"inner": self.inner.state_dict(), "prefetched": {"gen": gen, "version": version, "samples": samples}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "prefetched" in state and "inner" in state:
            self._restored = state["prefetched"]
            state = state["inner"]
        self.inner.load_state_dict(state)

    def close(self) -> None:
        if self._future is not None:
            self._future.exception()  # the background drive ends before its controller is closed
            self._future = None
        self._thread.shutdown(wait=True)
        self.inner.close()
