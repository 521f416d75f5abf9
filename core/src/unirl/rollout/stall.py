"""The stall timeout of every rollout mode (``rollout.stall_timeout_s``): a hung engine fails the run fast.

Why: a collect that never returns used to hold the trainer forever (an engine process wedged in a
kernel, a lost reply from a Ray actor). Silence for ``stall_timeout_s`` is reported instead, as
:class:`EngineStalledError`, a restartable :class:`~unirl.kernel.errors.WorkerLostError` (so
``run.max_restarts`` restarts the run from its last checkpoint), naming the engine, the launch and the
requests it holds.

**Progress** is what resets the clock: a launch that returned, or the engine's own report
(:meth:`unirl.contracts.RolloutEngine.progress`: the last decode step or finished request, every engine
built on :class:`unirl.engine.queued.QueuedEngine` reports it). A long generation that keeps producing
tokens is never a stall; an engine that cannot report progress is judged by its launches alone.

**Where the wait happens.** :func:`watched` runs one blocking collect on a fresh thread and waits for it
on the caller's (the trainer's, or the async controller's) with the stall check. A hung engine cannot be
interrupted, so on a stall its thread is left behind (a daemon) and the caller raises. The thread ends
with its collect, so it keeps no OpenMP team alive between steps (see :mod:`unirl.engine.queued`).
Ctrl-C still reaches the trainer, which waits in Python, not inside the engine. The whole collect moves
(the controller is any plugin's), so its scoring runs off the main thread too, as in async and stream mode:
a reward that bounds itself by a main-thread signal (``math_verify``'s parse timeout) is unbounded there,
and the stall timeout is then what ends a parse that never returns (the message says the engine is idle).
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from unirl.contracts import RolloutEngine
from unirl.kernel.errors import WorkerLostError

T = TypeVar("T")

#: request ids named in a stall message (the rest are counted)
NAMED_REQUESTS = 8


class EngineStalledError(WorkerLostError):
    """No progress for ``rollout.stall_timeout_s`` while a launch ran (or a sync's pause could not stop
    the running requests in that time): the message names the engine, the launches and the requests.
    A restartable loss (``run.max_restarts``), like a killed engine."""


def last_progress(engine: RolloutEngine, since: float) -> float:
    """The latest ``time.monotonic()`` at which ``engine`` made progress, not earlier than ``since``
    (when the waiting began, or the last launch returned)."""
    report = engine.progress()
    return since if report is None else max(since, report.last_at)


def stall_error(engine: RolloutEngine, engine_name: str, timeout_s: float, launches: Iterable[str]) -> EngineStalledError:
    """The one message of a stall: engine, timeout, launches, the requests the engine holds, the fix."""
    report = engine.progress()
    ids = list(report.requests) if report is not None else []
    named = ", ".join(ids[:NAMED_REQUESTS]) + (f" and {len(ids) - NAMED_REQUESTS} more" if len(ids) > NAMED_REQUESTS else "")
    held = f"requests {named} on the engine" if ids else f"{engine.in_flight} request(s) on the engine"
    if report is not None and not ids:  # the engine is idle: the launch's own work hung (scoring, a tool)
        held += " (the engine holds none: the controller's own work, a reward or a tool call, did not return)"
    return EngineStalledError(
        f"rollout engine '{engine_name}' made no progress for rollout.stall_timeout_s={timeout_s:g} s: launches "
        f"{', '.join(launches)} in flight, {held}. Restart from the latest checkpoint "
        "(run.resume=true), or let run.max_restarts do it; raise rollout.stall_timeout_s if a step may "
        "legitimately produce no token for that long.")


def watched(call: Callable[[], T], *, engine: RolloutEngine, engine_name: str, timeout_s: float,
            launch: str) -> T:
    """``call()`` (one blocking collect, launch tag ``launch``) on a fresh thread; returns its result or
    raises its error, or raises :class:`EngineStalledError` once neither it nor the engine made progress
    for ``timeout_s`` seconds. The thread carries the caller's context variables."""
    done, box = threading.Event(), {}
    ctx = contextvars.copy_context()

    def run() -> None:
        try:
            box["out"] = ctx.run(call)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["err"] = exc
        finally:
            done.set()

    name = f"{threading.current_thread().name}:{launch}"  # the caller's name first (which side collects)
    threading.Thread(target=run, name=name, daemon=True).start()
    started = time.monotonic()
    while not done.wait(min(1.0, timeout_s / 4)):
        if time.monotonic() - last_progress(engine, started) > timeout_s:
            raise stall_error(engine, engine_name, timeout_s, [launch])
    if "err" in box:
        raise box["err"]
    return box["out"]
