"""The bridge between the endpoint's request handlers (an asyncio loop thread) and the rollout engine.

Why one pump thread: handlers arrive concurrently from many agents, but the engine contract is a
non-blocking submit / poll / abort driven from one place. The pump batches whatever requests are waiting
into one ``engine.submit`` (the embedded engine then decodes them together), polls, and resolves each
handler's future on its loop. :meth:`pause` is the contract's weight-sync rule for this server: no new
request reaches the engine, the ones running finish, and only then may weights load; :meth:`resume`
lets the queued requests through under the new version.

**Gathering.** A job of one request wastes the batch (an engine that runs one job at a time makes the
next request wait for it anyway; one that merges jobs still pays a prefill per job). The pump therefore submits when nothing of ours
runs on the engine and either every live agent (:meth:`agent_started` / :meth:`agent_ended`) is waiting
on the model, or no request arrived for ``gather_s`` (50 ms) while none is on its way and the agents'
loop is idle (agents share one loop thread, so after a job their next turns arrive one after another),
or the oldest has waited ``max_gather_s`` (2 s): the lockstep batches of the built-in controller when
agents are quick, no stall when one is slow. Results go back the same way, one hand-off per loop and poll.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from unirl.api import Handle, RolloutEngine, Sample, SamplingParams


@dataclass
class _Request:
    sample: Sample
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class EngineBridge:
    def __init__(self, engine: RolloutEngine, max_inflight: int = 64, gather_s: float = 0.05,
                 max_gather_s: float = 2.0):
        self.engine, self.max_inflight, self.gather_s, self.max_gather_s = engine, max_inflight, gather_s, max_gather_s
        self._queue: queue.Queue[list[_Request]] = queue.Queue()  # batches handed over by a loop's flush
        self._unsent: dict[asyncio.AbstractEventLoop, list[_Request]] = {}  # per loop: not yet handed over
        self._waiting: list[tuple[float, _Request]] = []  # taken off the queue, not yet submitted
        self._pending, self._cap = 0, 0  # agents of the drive not yet returned; how many run at once
        self._open: dict[str, int] = {}  # per session: HTTP requests sent and not yet answered
        self.loop: asyncio.AbstractEventLoop | None = None  # the agents' loop (set by the controller)
        self._handles: dict[int, tuple[Handle, dict[str, _Request]]] = {}
        self._paused = False
        self._cond = threading.Condition()
        self.turns = 0

    # ------------------------------------------------------------------ handler side (loop thread)
    async def generate(self, sample: Sample, sampling: SamplingParams) -> Sample:
        """One model turn appended to ``sample`` in place (the engine contract), awaited."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        unsent = self._unsent.setdefault(loop, [])
        if not unsent:  # the first of a round: hand the round over once the loop's ready callbacks ran
            loop.call_soon(self._flush, loop)
        unsent.append(_Request(sample, sampling, loop, fut))
        return await fut

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """Hand the requests that arrived in one pass of the loop to the pump as one batch. Why: one
        ``queue.put`` per request woke the pump thread once per request (64 a turn), and each wake-up
        took the GIL from the agents' loop, a thread hop a loaded machine charges for (measured:
        ``benchmarks/agent_endpoint_overhead.py``)."""
        batch = self._unsent.pop(loop, [])
        if batch:
            self._queue.put(batch)

    def expect(self, agents: int, concurrency: int) -> None:
        """A drive of ``agents`` agents starts, ``concurrency`` at a time (counted before any of them runs:
        counting them as they start would submit the first arrivals alone)."""
        self._pending, self._cap = agents, concurrency

    def agent_started(self) -> None:
        pass

    def agent_ended(self, key: str = "") -> None:
        self._pending -= 1
        self._open.pop(key, None)

    def sent(self, key: str) -> None:
        self._open[key] = self._open.get(key, 0) + 1

    def answered(self, key: str) -> None:
        self._open[key] = self._open.get(key, 1) - 1

    @property
    def live(self) -> int:
        """Agents that may send a turn now (0: none tracked, submit at once)."""
        return min(self._pending, self._cap)

    # ------------------------------------------------------------------ weight syncs (any thread)
    def pause(self, timeout: float = 600.0) -> None:
        """Hold new requests; return once none of ours is running on the engine."""
        with self._cond:
            self._paused = True
            if not self._cond.wait_for(lambda: not self._handles, timeout):
                raise TimeoutError("pause: engine requests still running")

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def _loop_idle(self) -> bool:
        """Whether the agents' loop runs a callback within 5 ms: busy, it is running agents' code (on a
        loaded machine 64 agents take seconds to send their turns, one after another)."""
        if self.loop is None:
            return True
        ran = threading.Event()
        try:
            self.loop.call_soon_threadsafe(ran.set)
        except RuntimeError:
            return True
        return ran.wait(0.005)

    @property
    def in_flight(self) -> int:
        return sum(len(r) for _, r in self._handles.values())

    # ------------------------------------------------------------------ the pump (one thread)
    def pump(self, until: Callable[[], bool]) -> None:
        """Serve requests until ``until()`` is true and none of ours is in flight or queued."""
        while True:
            self._submit()
            if self._handles:
                self._poll(0.02)  # returns as soon as a job completes
            elif not self._waiting and self._queue.empty() and until():
                return
            else:  # idle, or gathering: sleep on the queue, not in a busy loop (the GIL is the agents')
                wait = 0.01 if not self._waiting else self.gather_s - (time.perf_counter() - self._waiting[-1][0])
                try:
                    got = self._queue.get(timeout=max(wait, 0.001))
                    self._waiting.extend((time.perf_counter(), r) for r in got)
                except queue.Empty:
                    pass

    def _submit(self) -> bool:
        with self._cond:
            if self._paused:
                return False
        while True:
            try:
                got = self._queue.get_nowait()
                self._waiting.extend((time.perf_counter(), r) for r in got)
            except queue.Empty:
                break
        self._waiting = [(t, r) for t, r in self._waiting if not r.future.cancelled()]
        if not self._waiting or self._handles:
            return False  # a job of ours runs: what arrives meanwhile joins the next batch
        now = time.perf_counter()
        if len(self._waiting) < self.live and now - self._waiting[0][0] < self.max_gather_s:
            on_the_way = sum(self._open.values()) > len(self._waiting)
            if on_the_way or not self._loop_idle() or now - self._waiting[-1][0] < self.gather_s:
                return False  # a turn is on its way, or agents are running their own code
        batch = [r for _, r in self._waiting[:self.max_inflight]]
        self._waiting = self._waiting[self.max_inflight:]
        by_params: dict[SamplingParams, list[_Request]] = {}
        for r in batch:
            by_params.setdefault(r.sampling, []).append(r)
        for sampling, reqs in by_params.items():
            try:
                h = self.engine.submit([r.sample for r in reqs], sampling)
            except Exception as exc:  # noqa: BLE001 - the engine refused: these requests fail, not the pump
                for r in reqs:
                    self._resolve(r, exc)
                continue
            with self._cond:
                self._handles[h.id] = (h, {r.sample.id: r for r in reqs})
        return bool(batch)

    def _poll(self, timeout: float) -> bool:
        got, settled = False, []
        for hid, (h, reqs) in list(self._handles.items()):
            try:
                done = self.engine.poll(h, timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - the engine failed this job: its requests fail
                settled += [(r, exc) for r in reqs.values()]
                reqs.clear()
                done = []
            for s in done:
                r = reqs.pop(s.id, None)
                if r is not None:
                    settled.append((r, s))
                    self.turns += 1
            got = got or bool(done)
            if not reqs:
                with self._cond:
                    self._handles.pop(hid, None)
                    self._cond.notify_all()
            timeout = 0.0
        self._settle(settled)
        return got

    def _resolve(self, r: _Request, result: Sample | BaseException) -> None:
        self._settle([(r, result)])

    @staticmethod
    def _settle(results: list[tuple[_Request, Sample | BaseException]]) -> None:
        """Hand results back to their loops, one ``call_soon_threadsafe`` per loop and poll. Why: one per
        request wrote the loop's self-pipe and woke it once per request (64 a turn), each wake-up a
        GIL hand-over between the pump and the agents' loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Request, Sample | BaseException]]] = {}
        for r, result in results:
            by_loop.setdefault(r.loop, []).append((r, result))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle_all, items)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass


def _settle_all(items: list[tuple[_Request, Sample | BaseException]]) -> None:
    """On the requests' loop: each future gets its sample or its error (unless it was cancelled)."""
    for r, result in items:
        if r.future.done():
            continue
        if isinstance(result, BaseException):
            r.future.set_exception(result)
        else:
            r.future.set_result(result)
