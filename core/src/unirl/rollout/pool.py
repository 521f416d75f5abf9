"""InflightPool: launches on a rollout engine without blocking, and reaps them complete-or-nothing.

Why its own module: the failure rules of overlapped rollout are easy to get subtly wrong, and every
engine shares them here, written once on the contract's ``submit`` / ``poll`` (the engine runs the
work on its own thread, process or Ray actor):

* **complete-or-nothing**: a launch is handed to the completion handler only when every one of its
  samples is back. A handler that raises leaves the launch *pending* (its samples kept) and it is
  retried on the next reap; it is removed only once the handler returns, so a retry never inserts
  twice (the handler is called with the same launch, and the buffer refuses a group it holds);
* **first-error deferral**: one bad launch does not stop the others being reaped; the first error is
  re-raised after the reap has gone through every launch (later ones are attached as notes);
* **KeyboardInterrupt passes through** at once (only ``Exception`` is deferred);
* an engine that fails a launch (its ``poll`` raises, e.g. a killed Ray actor) or stalls past
  ``stall_timeout_s`` raises :class:`EngineFailedError` naming the engine; that launch is dropped whole,
  so no group from it is ever half-consumed;
* :meth:`InflightPool.drain_all` quiesces: it returns only when nothing is in flight on the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from unirl.contracts import Handle, RolloutEngine, SamplingParams
from unirl.kernel.errors import WorkerLostError
from unirl.samples import Sample


class EngineFailedError(WorkerLostError):
    """The rollout engine failed or stalled with a launch in flight; the message names the engine."""


@dataclass
class Launch:
    """One non-blocking generation: the samples of a batch, stamped at launch."""

    gen_id: int
    version: int  # the weight version the engine served when this was submitted
    handle: Handle
    samples: list[Sample]
    launched_at: float  # time.time()
    finished_at: float = 0.0  # when the engine handed the last sample back
    returned: set[str] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return len(self.returned) == len(self.samples)


class InflightPool:
    """The launches of one engine that are in flight (on the engine) or pending (back, not yet handled)."""

    def __init__(self, engine: RolloutEngine, engine_name: str, *, stall_timeout_s: float = 600.0) -> None:
        self.engine = engine
        self.engine_name = engine_name
        self.stall_timeout_s = stall_timeout_s
        self._launches: dict[int, Launch] = {}  # gen_id -> launch, in launch order

    # ------------------------------------------------------------------ state
    @property
    def in_flight(self) -> int:
        """Launches the engine has not handed back whole yet."""
        return sum(not x.complete for x in self._launches.values())

    @property
    def pending(self) -> int:
        """Launches back from the engine whose completion handler has not succeeded yet."""
        return sum(x.complete for x in self._launches.values())

    def __len__(self) -> int:
        return len(self._launches)

    def open_launches(self) -> list[Launch]:
        """Launches not yet handed back whole by the engine, oldest first."""
        return [x for x in self._launches.values() if not x.complete]

    # ------------------------------------------------------------------ launch / reap
    def launch(self, gen_id: int, samples: list[Sample], sampling: SamplingParams, *, version: int) -> Launch:
        """Submit ``samples`` (returns at once) stamped with ``version``, the version served now."""
        if gen_id in self._launches:
            raise ValueError(f"launch {gen_id} is already in the pool")
        handle = self.engine.submit(samples, sampling)
        launch = Launch(gen_id, int(version), handle, list(samples), time.time())
        self._launches[gen_id] = launch
        return launch

    def reap(self, on_complete: Callable[[Launch], None], timeout: float = 0.0) -> int:
        """Hand every complete launch to ``on_complete``; wait up to ``timeout`` s for one if none is.

        Returns how many launches were handled. Raises the first deferred error after going through all."""
        errors: list[BaseException] = []
        handled = self._reap(on_complete, timeout, errors, skip=set())
        self._raise_first(errors)
        return handled

    def drain_all(self, on_complete: Callable[[Launch], None], *, poll_s: float = 0.5) -> int:
        """Quiesce: wait until the engine has handed back every launch, handling each.

        Errors are deferred until nothing is in flight (so a sync may follow); the first is re-raised.
        A launch whose handler failed is not retried within this drain; it stays pending (not in
        flight) for the next reap."""
        errors: list[BaseException] = []
        failed: set[int] = set()
        handled = 0
        while True:
            handled += self._reap(on_complete, poll_s, errors, skip=failed)
            if not self.in_flight:
                break
        self._raise_first(errors)
        return handled

    def abort_all(self) -> list[Launch]:
        """End every launch on the engine now and forget them (their samples are not handled)."""
        out = list(self._launches.values())
        for launch in out:
            if not launch.complete:
                try:
                    self.engine.abort(launch.handle)
                except Exception:  # noqa: BLE001 - the engine may be the thing that died
                    pass
        self._launches.clear()
        return out

    # ------------------------------------------------------------------ internals
    def _reap(self, on_complete: Callable[[Launch], None], timeout: float, errors: list[BaseException],
              skip: set[int]) -> int:
        """One reap; errors are appended (deferred), launches whose handler failed are added to ``skip``."""
        self._poll_all(errors, wait=0.0)
        ready = [x for x in self._launches.values() if x.complete and x.gen_id not in skip]
        if not ready and timeout > 0 and self.in_flight:
            self._poll_all(errors, wait=timeout)
            ready = [x for x in self._launches.values() if x.complete and x.gen_id not in skip]
        handled = 0
        for launch in ready:
            try:
                on_complete(launch)
            except Exception as exc:  # noqa: BLE001 - deferred; the launch stays pending for a retry
                errors.append(exc)
                skip.add(launch.gen_id)
                continue
            del self._launches[launch.gen_id]
            handled += 1
        return handled

    def _poll_all(self, errors: list[BaseException], wait: float) -> None:
        """Collect what the engine has finished; with ``wait``, block on the oldest launch in flight.

        The engine's queue is first-in first-out, so the oldest launch is the next to finish."""
        now = time.time()
        for launch in list(self._launches.values()):
            if launch.complete:
                continue
            try:
                got = self.engine.poll(launch.handle, timeout=wait)
            except Exception as exc:  # noqa: BLE001 - the engine lost this launch: drop it whole
                del self._launches[launch.gen_id]
                err = EngineFailedError(
                    f"rollout engine '{self.engine_name}' failed launch {launch.gen_id} ({len(launch.samples)} "
                    f"samples, weight version {launch.version}): {type(exc).__name__}: {exc}. No sample of it "
                    "entered the buffer; restart from the latest checkpoint (run.resume=true).")
                err.__cause__ = exc
                errors.append(err)
                continue
            wait = 0.0  # block at most once per reap
            for s in got:
                launch.returned.add(s.id)
            if launch.complete:  # the engine's own clock (request records) when it has one
                ends = [s.requests[-1].finished_ms / 1000.0 for s in launch.samples if s.requests]
                launch.finished_at = max(ends) if ends and min(ends) > 0 else time.time()
            elif now - launch.launched_at > self.stall_timeout_s:  # forget it: a hung engine may never answer
                del self._launches[launch.gen_id]
                errors.append(EngineFailedError(
                    f"rollout engine '{self.engine_name}' has not finished launch {launch.gen_id} in "
                    f"{now - launch.launched_at:.0f} s (stall_timeout_s={self.stall_timeout_s:g}); the engine is "
                    "hung or dead. Restart from the latest checkpoint (run.resume=true)."))

    @staticmethod
    def _raise_first(errors: list[BaseException]) -> None:
        if not errors:
            return
        first = errors[0]
        for later in errors[1:]:
            first.add_note(f"also: {type(later).__name__}: {later}")
        raise first
