"""The async rollout mechanism: the launch ceiling, the only way weights move, and the controller
wrapper that collects the next step's batch while the trainer trains.

Three rules make overlapped rollout safe, for every controller (core's ``batch`` or a plugin's), on top
of the engine contract only (no engine-specific code):

1. **launch-time stamps**: a collect is stamped with the version the engine serves *when it starts*;
   staleness is measured from that stamp (or, finer, from each sample's oldest token version), never
   from when it happened to finish;
2. **the launch ceiling** (:func:`launch_ceiling`, one pure formula): collect ``g`` is the batch
   trained at step ``g``, and step ``g`` trains while the ledger holds
   ``version_at(g) = base + (g - first_gen) // weight_sync_interval``. A collect may start now only if
   it will be at most ``max_staleness`` versions old when consumed. With ``max_staleness=0`` nothing
   launches into a future sync window, so every batch is on-policy (PPO ratio 1 on its first update);
3. **quiesce before bump**: :meth:`PrefetchingController.sync_weights` refuses while a collect runs,
   then hands over to :func:`publish_next`, the one publish path of the project (the sync driver calls
   it too), so the ledger advances only between collects.

The trainer's drivers decide when to call what (``unirl.trainer.drivers``: the window, the end of the
run and the checkpoint schedule are policy); eval and checkpoints call ``quiesce()`` first, and eval
never pushes weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
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
from unirl.kernel.errors import SyncRefusedError, WorkerLostError
from unirl.samples import Sample, now_ms


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


#: ``on_published(version, receipts, lag_s, started_ms)``: told once per committed version (the trainer fires
#: the hook); ``started_ms`` (:func:`unirl.samples.now_ms`) is when the sync took the engine out of service
OnPublished = Callable[[int, list[Receipt], float, float], None]


def publish_next(ledger: VersionLedger, transport: WeightSync, actor: Actor, engine: RolloutEngine,
                 on_published: OnPublished | None = None, *,
                 paused_at_ms: float | None = None) -> tuple[int, list[Receipt]]:
    """Publish the actor's weights to ``engine`` as the ledger's next version and commit it (the ledger
    checks the receipts), then tell ``on_published``. The one publish path: the sync trainer calls it
    directly, the controllers' :meth:`sync_weights` after their in-flight check. ``paused_at_ms``: when a
    caller that paused the engine first (stream mode) stopped it admitting work; else the publish's start."""
    t0 = time.perf_counter()
    started_ms = now_ms() if paused_at_ms is None else paused_at_ms
    version = ledger.version + 1
    receipts, manifest = transport.publish(actor, engine, version)
    ledger.commit(version, receipts, manifest)
    if on_published is not None:
        on_published(version, receipts, time.perf_counter() - t0, started_ms)
    return version, receipts


#: ``collect() -> samples``: one step's ``RolloutController.collect`` (the trainer binds draw, groups, n, sampling)
Collect = Callable[[], list[Sample]]


class PrefetchingController(RolloutController):
    """``rollout.mode: async`` with ``rollout.controller``: the next step's :meth:`RolloutController.collect`
    runs on a background thread while the trainer trains on the current batch.

    The three rules of the module doc, for any controller (one generate, multi-turn trajectories,
    partial rollout):

    1. **stamps**: each collect is launched under the version the engine serves then; every trajectory
       it returns also carries its own ``meta["min_version"]`` (oldest model token, older for a carried
       tail), and at consumption :meth:`next_batch` stamps ``meta["staleness"]`` = ledger version minus
       that oldest token's version;
    2. **the launch ceiling**: collect ``g`` (the batch step ``g`` trains on) may start now only if
       ``version_at(g) <= ledger.version + max_staleness``; with ``max_staleness: 0`` nothing overlaps a
       sync, so the run is on-policy;
    3. **quiesce before bump**: :meth:`sync_weights` refuses while a collect runs (:meth:`quiesce` first).

    It wraps the trainer's controller and is one itself (``state_dict``, ``warm_start_samples`` and
    ``metrics`` delegate; :meth:`close` waits for the background collect before closing the inner one).
    The async driver owns it and calls :meth:`stop` (the recipe's controller is the components' to
    close). Only one collect is in flight at a time: the controller owns its own over-generation, so one
    more drive in flight is all the overlap it needs.
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
    def launch_ceiling(self) -> int:
        """The first collect that may *not* start now (:func:`launch_ceiling` at the ledger's version)."""
        return launch_ceiling(self.ledger.version, first_gen=self.first_gen, base_version=self.base_version,
                              interval=self.interval, max_staleness=self.max_staleness)

    @property
    def in_flight(self) -> int:
        return int(self._future is not None and not self._future.done())

    def launch(self, gen_id: int, collect: Collect) -> bool:
        """Start collect ``gen_id`` in the background, as the driver's policy asks (it checked the
        window); refused (False) only when a collect is pending or ``gen_id`` is not the next one."""
        if self._future is not None or gen_id != self.next_gen:
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
        """Wait until the background collect (if any) is done; its batch stays ready. Returns seconds.
        A lost or stalled engine (:class:`~unirl.kernel.errors.WorkerLostError`) is raised here, before a
        sync would be refused by the requests it still holds; any other error waits for ``next_batch``."""
        t0 = time.perf_counter()
        if self._future is not None:
            error = self._future.exception()  # waits
            if isinstance(error, WorkerLostError):
                raise error
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
                sampling: SamplingParams, launch_tag: str) -> list[Sample]:
        """A blocking collect (nothing prefetched may be pending: its batch would be skipped)."""
        if self._future is not None:
            raise RuntimeError("collect() while a prefetched batch is pending; take it with next_batch()")
        return self.inner.collect(draw, groups=groups, n=n, sampling=sampling, launch_tag=launch_tag)

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

    def stop(self) -> None:
        """The background collect ends and its thread stops; the inner controller stays open (its owner,
        the run's components, closes it). Idempotent."""
        if self._future is not None:
            self._future.exception()  # the background drive ends before its controller is closed
            self._future = None
        self._thread.shutdown(wait=True)

    def close(self) -> None:
        self.stop()
        self.inner.close()
