"""The non-blocking half of the engine contract, written once for every engine that runs batches.

:class:`QueuedEngine` turns one blocking method, :meth:`QueuedEngine._run` ("append one model turn
to each of these samples; stop early when ``should_stop()`` says so"), into the whole
submit / poll / abort / pause / resume contract of :class:`unirl.contracts.RolloutEngine`:

* ``submit`` validates the samples, stamps a :class:`~unirl.samples.RequestRecord` (submitted time,
  engine) on each and queues them as one job; a worker thread runs jobs in order;
* ``poll`` hands back completed samples once each; ``abort`` flags running jobs (the engine stops at
  its next token and keeps what it generated, ``finish_reason="abort"``), ends queued jobs with an
  empty turn, and returns all of them, so nothing of that handle is left in flight or in ``poll``;
* ``pause`` keeps the worker from starting new jobs; ``quiesced(version)`` is the guard an engine's
  ``load_weights`` runs under: it raises :class:`~unirl.kernel.errors.SyncRefusedError` while a job is
  queued, running or done but not yet reaped (``in_flight``), and holds new jobs back until the load
  is over.

The embedded torch engine and the vLLM engine both build on it, so the bookkeeping that makes
"leaks no request" true exists once.
"""

from __future__ import annotations

import contextlib
import threading
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from unirl.contracts import Handle, RolloutEngine, SamplingParams
from unirl.kernel.errors import SampleError, SyncRefusedError
from unirl.samples import RequestRecord, Sample, now_ms


@dataclass
class _Job:
    handle: Handle
    samples: list[Sample]
    sampling: SamplingParams
    stop: threading.Event = field(default_factory=threading.Event)
    state: str = "queued"  # queued | running | done
    error: BaseException | None = None


class QueuedEngine(RolloutEngine):
    """Base class: subclasses implement :meth:`_run`, :meth:`capabilities`, ``stage`` and
    ``load_weights`` (inside ``with self.quiesced(version):``), and call ``super().__init__()``."""

    #: the worker id stamped on request records (a multi-worker engine overrides per request)
    worker_id: str = "0"

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._jobs: dict[int, _Job] = {}
        self._next_handle = 0
        self._paused = False
        self._syncing = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._version = 0

    # ------------------------------------------------------------------ for subclasses
    @abstractmethod
    def _run(self, samples: list[Sample], sampling: SamplingParams, should_stop: Callable[[], bool],
             version: int) -> None:
        """Append one model turn to every sample (``Sample.append_model_turn``), blocking.

        Check ``should_stop()`` between tokens; when it turns True, end every unfinished sample with
        what it has so far and ``finish_reason="abort"``. Set ``sample.requests[-1].first_token_ms``
        (and ``worker`` when not :attr:`worker_id`); the base fills the rest of the record."""

    @property
    def weight_version(self) -> int:
        return self._version

    def _set_version(self, version: int) -> None:
        """Called by ``load_weights`` once the new weights serve."""
        self._version = int(version)

    @contextlib.contextmanager
    def quiesced(self, version: int) -> Iterator[None]:
        """Guard for ``load_weights``: refuse while anything runs, hold new work back during the load."""
        with self._cv:
            busy = self._in_flight()
            if busy or self._syncing:
                why = f"{busy} request(s) in flight" if busy else "another sync is running"
                raise SyncRefusedError(
                    f"{type(self).__name__}: weight sync to version {version} refused: {why}; the engine "
                    f"still serves version {self._version}. Reap (poll), abort or pause and drain first.")
            self._syncing = True
        try:
            yield
        finally:
            with self._cv:
                self._syncing = False
                self._cv.notify_all()

    # ------------------------------------------------------------------ the contract
    @property
    def in_flight(self) -> int:
        with self._cv:
            return self._in_flight()

    def _in_flight(self) -> int:
        # queued, running, or done and not yet handed back by poll/abort (the contract's definition):
        # a sync between "done" and "reaped" would leave a controller holding unreaped work
        return sum(len(j.samples) for j in self._jobs.values())

    def submit(self, samples: list[Sample], sampling: SamplingParams) -> Handle:
        ids = [s.id for s in samples]
        if len(set(ids)) != len(ids):
            raise SampleError(f"{type(self).__name__}.submit: a sample id appears twice in one submission")
        for s in samples:
            if not s.prompt_ids:
                raise SampleError(f"sample {s.id}: empty prompt_ids (nothing to condition on)")
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{type(self).__name__} is closed")
            live = {sid for j in self._jobs.values() for sid in j.handle.sample_ids}
            clash = sorted(live.intersection(ids))
            if clash:
                raise SampleError(f"sample {clash[0]} is already in flight on this engine; request ids must "
                                  "be unique per launch")
            handle = Handle(self._next_handle, tuple(ids))
            self._next_handle += 1
            if not samples:
                return handle
            t = now_ms()
            for s in samples:
                s.requests.append(RequestRecord(turn=s.turns, engine=self.name, worker=self.worker_id,
                                                prompt_tokens=len(s.context_ids), submitted_ms=t))
            job = _Job(handle, list(samples), sampling)
            self._jobs[handle.id] = job
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, name=f"{self.name or 'engine'}-rollout",
                                                daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return handle

    def poll(self, handle: Handle | None = None, timeout: float = 0.0) -> list[Sample]:
        with self._cv:
            self._cv.wait_for(lambda: self._done_jobs(handle), timeout=timeout if timeout > 0 else 0)
            done = self._done_jobs(handle)
            failed = next((j for j in done if j.error is not None), None)
            if failed is not None:  # raise for that job only; the others stay to be polled
                del self._jobs[failed.handle.id]
                raise failed.error
            out: list[Sample] = []
            for job in done:
                del self._jobs[job.handle.id]
                out.extend(job.samples)
            return out

    def abort(self, handle: Handle | None = None) -> list[Sample]:
        with self._cv:
            jobs = [j for j in self._jobs.values() if handle is None or j.handle.id == handle.id]
            for job in jobs:
                job.stop.set()
                if job.state == "queued":  # never started: an empty, aborted turn
                    self._queue.remove(job)
                    for s in job.samples:
                        s.append_model_turn([], [], self._version, "abort")
                    self._finish(job)
            self._cv.notify_all()
            self._cv.wait_for(lambda: all(j.state == "done" for j in jobs))
            out: list[Sample] = []
            for job in jobs:
                self._jobs.pop(job.handle.id, None)
                out.extend(job.samples)
            return out

    def pause(self) -> None:
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def close(self) -> None:
        """Abort everything, stop the worker thread. Subclasses release their model after this."""
        if self._closed:
            return
        self.abort()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ internals
    def _done_jobs(self, handle: Handle | None) -> list[_Job]:
        return [j for j in self._jobs.values()
                if j.state == "done" and (handle is None or j.handle.id == handle.id)]

    def _finish(self, job: _Job) -> None:
        t = now_ms()
        for s in job.samples:
            rec = s.requests[-1]
            seg = s.segments[-1] if s.segments and s.segments[-1].kind == "model" else None
            rec.new_tokens = (seg.end - seg.start) if seg is not None else 0
            rec.version = s.versions[-1] if rec.new_tokens else self._version
            rec.finish_reason = s.finish_reason
            rec.finished_ms = t
        job.state = "done"

    def _worker(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or (self._queue and not self._paused and not self._syncing))
                if self._closed:
                    return
                job = self._queue.popleft()
                job.state = "running"
                version = self._version
            try:
                self._run(job.samples, job.sampling, job.stop.is_set, version)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever polls the handle
                job.error = exc
            with self._cv:
                self._finish(job)
                self._cv.notify_all()
