"""The non-blocking half of the engine contract, written once for every engine that runs batches.

:class:`QueuedEngine` turns one blocking method, :meth:`QueuedEngine._run` ("append one model turn
to each of these samples; stop early when ``should_stop()`` says so"), into the whole
submit / poll / abort / pause / resume contract of :class:`unirl.contracts.RolloutEngine`:

* ``submit`` validates the samples, stamps a :class:`~unirl.samples.RequestRecord` (submitted time,
  engine) on each and queues them as one job; a worker thread runs jobs in order (``generate`` may
  run its job on the caller's thread instead, see **Threads** below);
* ``poll`` hands back completed samples once each; ``abort`` flags running jobs (the engine stops at
  its next token and keeps what it generated, ``finish_reason="abort"``), ends queued jobs with an
  empty turn, and returns all of them, so nothing of that handle is left in flight or in ``poll``;
* ``pause`` keeps the worker from starting new jobs; ``quiesced(version)`` is the guard an engine's
  ``load_weights`` runs under: it raises :class:`~unirl.kernel.errors.SyncRefusedError` while a job is
  queued, running or done but not yet reaped (``in_flight``), and holds new jobs back until the load
  is over.

**Threads.** ``generate`` (the blocking form the synchronous trainer uses) runs the job on the
caller's thread when the engine is idle, and the worker thread exits as soon as the queue is empty (the
next ``submit`` starts a new one). Both are for speed, and both come from libgomp, the OpenMP runtime
of torch's CPU build. Every thread that has run a parallel region keeps its own team of OpenMP
threads for as long as it lives. Once more of those threads exist than there are CPUs, libgomp cuts
every team's spin-wait short, so each parallel region then waits on a futex wake. An idle engine
thread that once decoded made every torch op in the process slower, the trainer's included. Measured
on 2 cores: a 64 x 256 x 768 matmul took 139 us instead of 71 us, and an 8 KB elementwise op took
70 us instead of 2 us. A GRPO step of ``benchmarks/grpo_step_vs_floor.py`` went from 1.29 s to 0.88 s
with the fix.

The embedded torch engine and the vLLM engine both build on it, so the bookkeeping that makes
"leaks no request" true exists once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from unirl.contracts import Handle, RolloutEngine, SamplingParams
from unirl.contracts.engine import EngineProgress
from unirl.kernel.errors import SampleError, SyncRefusedError
from unirl.samples import MODEL_ROLES, RequestRecord, Sample, now_ms


@dataclass
class _Job:
    handle: Handle
    samples: list[Sample]
    sampling: SamplingParams
    stop: threading.Event = field(default_factory=threading.Event)
    state: str = "queued"  # queued | running | done
    started: float = 0.0  # time.monotonic() when it began running (progress().busy_s)
    error: BaseException | None = None
    restart: bool = False  # restart_running() asked for it: back to the queue, its partial turn dropped
    before: list[Sample] = field(default_factory=list)  # the samples as they started running (restart_running)
    finished: threading.Event = field(default_factory=threading.Event)  # set once by _finish: wakes its generate

    def begin(self) -> None:
        """Now running: keep copies of the samples as they are, so a restart can put them back."""
        self.state, self.started = "running", time.monotonic()
        self.before = [s.copy() for s in self.samples]

    def rewind(self) -> None:
        """Back to queued with the samples as they started (nothing of the stopped run kept)."""
        for s, b in zip(self.samples, self.before, strict=True):
            s.__dict__.update(b.copy().__dict__)
        self.state, self.restart = "queued", False
        self.stop.clear()


class QueuedEngine(RolloutEngine):
    """Base class: subclasses implement :meth:`_run`, :meth:`capabilities`, ``stage`` and
    ``load_weights`` (inside ``with self.quiesced(version):``), and call ``super().__init__()``."""

    #: the worker id stamped on request records (a multi-worker engine overrides per request)
    worker_id: str = "0"
    #: how long :meth:`close` waits for running jobs to stop (a hung one is left behind: rollout.stall_timeout_s)
    close_wait_s: float = 10.0
    #: the engine's declaration that it batches across jobs (continuous batching): its :meth:`_run_merged`
    #: admits queued jobs into the running batch at decode-step boundaries. False (the default, vLLM's
    #: engine): one job at a time, since its ``_run`` need not be re-entrant (two at once crashed vLLM's
    #: scheduler). Only the worker thread runs merged batches, so ``generate`` queues on such an engine.
    merges_jobs: bool = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        """A subclass that replaces ``_run`` under a parent's ``merges_jobs = True`` would have its ``_run``
        skipped for every merged job: it must say which it means."""
        super().__init_subclass__(**kwargs)
        if "_run" in cls.__dict__ and "merges_jobs" not in cls.__dict__ and cls.merges_jobs:
            raise TypeError(f"{cls.__name__} overrides _run but inherits merges_jobs = True: merged jobs would "
                            "not run through it; fix: set merges_jobs = False in the class, or override _run_merged too")

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
        self._beat = time.monotonic()  # the last decode step (should_stop read) or finished job: progress()
        self._busy_s = 0.0  # request-seconds of finished jobs' running time: progress()

    # ------------------------------------------------------------------ for subclasses
    @abstractmethod
    def _run(self, samples: list[Sample], sampling: SamplingParams, should_stop: Callable[[], bool],
             version: int) -> None:
        """Append one model turn to every sample (``Sample.append_model_turn``), blocking.

        Check ``should_stop()`` between tokens; when it turns True, end every unfinished sample with
        what it has so far and ``finish_reason="abort"``. Set ``sample.requests[-1].first_token_ms``
        and ``finished_ms`` when each request really produced its first token and ended (per request,
        not per job: traces replay per-request latency), and ``worker`` when not :attr:`worker_id`;
        the base fills the rest of the record (and ``finished_ms`` with the job's end if left 0)."""

    def _can_merge(self, samples: list[Sample], sampling: SamplingParams) -> bool:
        """Whether this job may run in a merged batch (an engine that :attr:`merges_jobs` says which)."""
        return False

    def _run_merged(self, first: JobLane, feed: JobFeed) -> None:
        """Run ``first`` and whatever ``feed.admit`` hands over at decode-step boundaries as one batch;
        ``feed.finish`` each lane as its last row ends. Only called when :attr:`merges_jobs`."""
        raise NotImplementedError(f"{type(self).__name__} declares merges_jobs but has no _run_merged")

    def cache_tokens(self) -> int:
        """Tokens held in this engine's prefix cache now (0: empty), or -1 when the engine cannot say.
        Stamped on every request at submit (``RequestRecord.cache_tokens_at_submit``): a trace records
        whether a batch started on a cold or a warm cache, which a replay (always cold) cannot see."""
        return -1

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
            # paused (stream mode's sync): queued work starts later, under the new weights, and finished
            # work keeps its tokens' versions, so only a running job refuses (wait_running first)
            busy = self._running() if self._paused else self._in_flight()
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
        with self._cv:
            handle, job = self._register(samples, sampling, state="queued")
            if job is None:
                return handle
            self._queue.append(job)
            if self._thread is None:  # the last one exited when the queue ran dry (see the module doc)
                self._start_worker()
            self._cv.notify_all()
        return handle

    def _start_worker(self) -> None:  # caller holds _cv
        self._thread = threading.Thread(target=self._worker, name=f"{self.name or 'engine'}-rollout", daemon=True)
        self._thread.start()

    def generate(self, samples: list[Sample], sampling: SamplingParams) -> list[Sample]:
        """Blocking form. When nothing else is queued or running (and the engine is neither paused nor
        syncing) the job runs right here, on the caller's thread, with the same bookkeeping as a
        submitted one: it counts as in flight, ``abort`` from another thread stops it, and a sync is
        refused meanwhile. Otherwise it queues behind the others (the contract's submit-and-poll)."""
        with self._cv:
            busy = (self._queue or self._paused or self._syncing or self.merges_jobs
                    or any(j.state == "running" for j in self._jobs.values()))
            if busy:
                job = None
            else:
                handle, job = self._register(samples, sampling, state="running")
                if job is not None:
                    job.begin()
                version = self._version
        if busy:
            return self._wait_for(self.submit(samples, sampling), samples)
        if job is None:  # nothing to generate
            return samples
        try:
            self._run(job.samples, job.sampling, self._beating(job), version)
        except BaseException as exc:  # noqa: BLE001 - a failed job leaves nothing in flight
            job.error = exc
        with self._cv:
            if self._requeued(job):  # restart_running(): it runs again from the queue, under the new weights
                restarted = True
            else:
                restarted = False
                self._finish(job)
                self._jobs.pop(job.handle.id, None)
            self._cv.notify_all()
        if restarted:
            return self._wait_for(handle, samples)
        if job.error is not None:
            raise job.error
        return samples

    def _wait_for(self, handle: Handle, samples: list[Sample]) -> list[Sample]:
        """The blocking half of ``generate``: poll ``handle`` until its samples are back, or until an
        ``abort`` from another thread took them (the job is gone: its samples hold their aborted turns).
        It sleeps on its own job's event, not on the engine's condition: stream mode keeps dozens of
        ``generate`` calls waiting, and every job's end woke all of them (CPU taken from the trainer)."""
        waiting = set(handle.sample_ids)
        with self._cv:
            job = self._jobs.get(handle.id)
        while waiting and job is not None:
            job.finished.wait(timeout=0.5)
            waiting.difference_update(s.id for s in self.poll(handle))
            with self._cv:
                if handle.id not in self._jobs:
                    break
        return samples

    def _register(self, samples: list[Sample], sampling: SamplingParams, *,
                  state: str) -> tuple[Handle, _Job | None]:
        """Validate a submission, stamp its request records and enter it as a job in ``state`` (the
        caller holds ``_cv``). An empty submission gets a handle and no job."""
        ids = [s.id for s in samples]
        if len(set(ids)) != len(ids):
            raise SampleError(f"{type(self).__name__}.submit: a sample id appears twice in one submission")
        for s in samples:
            if not s.prompt_ids:
                raise SampleError(f"sample {s.id}: empty prompt_ids (nothing to condition on)")
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
            return handle, None
        t = now_ms()
        cached = self.cache_tokens()
        for s in samples:
            s.requests.append(RequestRecord(turn=s.turns, engine=self.name, worker=self.worker_id,
                                            prompt_tokens=len(s.context_ids), submitted_ms=t,
                                            cache_tokens_at_submit=cached))
        job = _Job(handle, list(samples), sampling, state=state, started=time.monotonic())
        self._jobs[handle.id] = job
        return handle, job

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

    def progress(self) -> EngineProgress:
        """The last decode step (every engine reads ``should_stop`` once a step) or finished job, and the
        ids of the requests held (queued, running, or done and not reaped), and the request-seconds spent
        running so far (each job's samples x its running time, the running jobs' time up to now)."""
        with self._cv:
            now = time.monotonic()
            busy = self._busy_s + sum(len(j.samples) * (now - j.started) for j in self._jobs.values()
                                      if j.state == "running")
            return EngineProgress(self._beat, tuple(i for j in self._jobs.values() for i in j.handle.sample_ids), busy)

    def _beating(self, job: _Job) -> Callable[[], bool]:
        """``should_stop`` for ``_run``: each call is a decode step, so it also stamps progress."""
        def should_stop() -> bool:
            self._beat = time.monotonic()
            return job.stop.is_set()
        return should_stop

    def abort(self, handle: Handle | None = None) -> list[Sample]:
        return self._abort(handle, None)

    def _abort(self, handle: Handle | None, timeout: float | None) -> list[Sample]:
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
            self._cv.wait_for(lambda: all(j.state == "done" for j in jobs), timeout=timeout)
            out: list[Sample] = []
            for job in (j for j in jobs if j.state == "done"):  # a hung job (timeout) stays running
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

    def wait_running(self, timeout: float) -> bool:
        """After :meth:`pause`: wait until no job runs (a running job finishes under the weights it started
        with; queued jobs keep their place). True once none runs, False after ``timeout`` seconds."""
        with self._cv:
            return self._cv.wait_for(lambda: self._running() == 0, timeout=timeout)

    def restart_running(self) -> list[str]:
        """``rollout.stream.on_sync: abort``: every running job stops at its next decode step, its partial turn
        is dropped (the samples are put back as they started) and it returns to the head of the queue, in
        order, to start again once the engine resumes: after :meth:`pause`, :meth:`wait_running` then sees
        it end at once, and it runs under the weights loaded meanwhile. Returns the restarted request ids."""
        with self._cv:
            jobs = [j for j in self._jobs.values() if j.state == "running"]
            for job in jobs:
                job.restart = True
                job.stop.set()
            return [i for j in jobs for i in j.handle.sample_ids]

    def _requeued(self, job: _Job) -> bool:
        """(caller holds ``_cv``) A job that stopped for :meth:`restart_running` goes back to the queue head."""
        if not job.restart or job.error is not None or self._closed:
            return False
        job.rewind()
        self._queue.appendleft(job)
        if self._thread is None:
            self._start_worker()
        return True

    def _running(self) -> int:
        return sum(len(j.samples) for j in self._jobs.values() if j.state == "running")

    def close(self) -> None:
        """Abort everything, stop the worker thread. Subclasses release their model after this. A job that
        does not stop within ``close_wait_s`` (a hung engine, already reported as a stall) is left behind."""
        if self._closed:
            return
        self._abort(None, self.close_wait_s)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
            hung = any(j.state == "running" for j in self._jobs.values())
        if thread is not None and not hung:
            thread.join(timeout=30)

    # ------------------------------------------------------------------ internals
    def _done_jobs(self, handle: Handle | None) -> list[_Job]:
        return [j for j in self._jobs.values()
                if j.state == "done" and (handle is None or j.handle.id == handle.id)]

    def _finish(self, job: _Job) -> None:
        """Complete each record. ``finished_ms`` is the engine's own per-request stamp when ``_run`` set
        one (the step a row ended at); only a record left unstamped (an empty or aborted turn) gets the
        job's end, which is then when that request really ended."""
        t = now_ms()
        self._beat = time.monotonic()
        if job.state == "running":
            self._busy_s += len(job.samples) * (self._beat - job.started)
        for s in job.samples:
            rec = s.requests[-1]
            sp = s.spans[-1] if s.spans and s.spans[-1].role in MODEL_ROLES else None
            rec.new_tokens = (sp.end - sp.start) if sp is not None else 0
            rec.version = s.versions[-1] if rec.new_tokens else self._version
            rec.finish_reason = s.finish_reason
            if rec.finished_ms <= 0.0:
                rec.finished_ms = t
        job.state = "done"
        job.finished.set()

    def _worker(self) -> None:
        """Run queued jobs in order, one at a time (never beside a running job), or one merged batch at a
        time on an engine that :attr:`merges_jobs`; exit once the queue is
        empty (see the module doc: an idle thread that keeps its OpenMP team slows every torch op in the
        process)."""
        while True:
            with self._cv:
                # one job at a time, also beside a job ``generate`` runs on its caller's thread (stream mode's
                # concurrent collects): an engine's ``_run`` need not be re-entrant (vLLM's scheduler is not)
                self._cv.wait_for(lambda: self._closed or not self._queue
                                  or (not self._paused and not self._syncing and not self._running()))
                if self._closed or not self._queue:
                    self._thread = None
                    return
                job = self._queue.popleft()
                job.begin()
                version = self._version
            if self.merges_jobs and self._can_merge(job.samples, job.sampling):
                self._merged(JobLane(job, version, self._beating(job)))
                continue
            try:
                self._run(job.samples, job.sampling, self._beating(job), version)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever polls the handle
                job.error = exc
            with self._cv:
                if not self._requeued(job):
                    self._finish(job)
                self._cv.notify_all()

    def _merged(self, first: JobLane) -> None:
        """One merged batch on the worker thread; an error fails every lane it had not finished."""
        feed = JobFeed(self, first)
        try:
            self._run_merged(first, feed)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever polls each handle
            for lane in list(feed.open):
                lane.job.error = exc
                feed.finish(lane)
        for lane in list(feed.open):  # a lane the engine never finished: a bug, not a silent hang
            lane.job.error = RuntimeError(f"{type(self).__name__}._run_merged returned with job "
                                          f"{lane.job.handle.id} unfinished")
            feed.finish(lane)


@dataclass
class JobLane:
    """One job in a merged batch: its samples and sampling, the weight version it runs under, and its
    ``should_stop`` (each call is a decode step: it stamps progress, as for a job run alone)."""

    job: _Job
    version: int
    should_stop: Callable[[], bool]

    @property
    def samples(self) -> list[Sample]:
        return self.job.samples

    @property
    def sampling(self) -> SamplingParams:
        return self.job.sampling


class JobFeed:
    """What a merged batch (:meth:`QueuedEngine._run_merged`) asks of the queue between decode steps.

    Why: a long-tail batch used to hold the engine until its longest row ended while launches queued
    behind it (stream mode ran one launch at a time). ``admit`` hands over queued jobs in order, whole,
    while they fit and share the batch's sampling; none while the engine is paused, syncing or closed,
    so a sync's ``wait_running`` sees the batch drain and queued jobs start under the new weights."""

    def __init__(self, engine: QueuedEngine, first: JobLane) -> None:
        self.engine, self.open = engine, [first]

    def _fits(self, room: int, sampling: SamplingParams) -> bool:  # caller holds the engine's _cv
        e = self.engine
        return bool(e._queue and not (e._paused or e._syncing or e._closed) and len(e._queue[0].samples) <= room
                    and e._queue[0].sampling == sampling and e._can_merge(e._queue[0].samples, sampling))

    def waiting(self, room: int, sampling: SamplingParams) -> bool:
        """Whether the next queued job would join now with ``room`` rows free."""
        with self.engine._cv:
            return self._fits(room, sampling)

    def admit(self, room: int, sampling: SamplingParams) -> list[JobLane]:
        """Queued jobs, in order, that fit in ``room`` rows and share ``sampling``; each now running."""
        e, out = self.engine, []
        with e._cv:
            while self._fits(room, sampling):
                job = e._queue.popleft()
                job.begin()
                room -= len(job.samples)
                out.append(JobLane(job, e._version, e._beating(job)))
        self.open.extend(out)
        return out

    def requeue(self, lane: JobLane) -> None:
        """``lane`` stopped for :meth:`QueuedEngine.restart_running`: back to the queue, nothing of it kept."""
        e = self.engine
        with e._cv:
            if not e._requeued(lane.job):
                e._finish(lane.job)
            e._cv.notify_all()
        self.open.remove(lane)

    def finish(self, lane: JobLane) -> None:
        """``lane``'s every sample has its turn: it is done (poll hands it back)."""
        e = self.engine
        with e._cv:
            e._finish(lane.job)
            e._cv.notify_all()
        self.open.remove(lane)
