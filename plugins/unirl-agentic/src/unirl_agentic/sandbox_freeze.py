"""Stop a ``python_sandbox`` session's processes between calls, and continue them at the next call.

Why: a call can leave processes behind (a forked child that keeps forking successors and burning CPU,
a thread of the worker) that run on after the call has returned, charged to no call. ``RLIMIT_CPU`` is
per process, so a chain of forks escaped it. Between calls every process of the session but its init
(pid 1, ours, idle in ``poll``) is SIGSTOPped; they resume at the next call, so a session burns CPU
only while one of its calls runs, and a call is bounded by ``timeout_s``.

How every process is found: all processes of the session's pid namespace descend from its init (an
orphan is re-parented to the init, or to a subreaper that is itself a descendant), so a walk of
``/proc/<pid>/task/<tid>/children`` from the init names them all. The walk can miss a child forked
during it, so the stop repeats until one walk finds every process stopped: a stopped process cannot
fork, so that state is stable. A session whose processes do not all stop within the deadline is killed
by the caller.

Cost: a stop has to wait until each process is scheduled to take it (a few ms on a loaded machine), so
the call only sends one pass of SIGSTOP (tens of microseconds) and returns; a stopper thread then
repeats the walk until everything is stopped, holding the session's lock; a next call that arrives
meanwhile ends that wait (the time between calls is over) and continues them.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable


def descendants(root: int) -> list[int]:
    """Every descendant of ``root`` (threads' children included), parents before children."""
    out: list[int] = []
    todo = [root]
    seen = {root}
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids = f.read().split()
            except OSError:
                continue
            for k in kids:
                k = int(k)
                if k not in seen:
                    seen.add(k)
                    out.append(k)
                    todo.append(k)
    return out


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"  # gone


def stop_all(root: int, timeout: float = 2.0, cancel=None) -> bool:
    """SIGSTOP every descendant of ``root`` until all are stopped (or gone): True, or False at ``timeout``.

    ``cancel()`` true ends it early with True: the next call is waiting, and it continues them anyway."""
    deadline = time.monotonic() + timeout
    rounds = 0
    while True:
        if cancel is not None and cancel():
            return True
        moving = [p for p in descendants(root) if _state(p) not in ("T", "t", "Z", "X")]
        if not moving:
            return True
        if time.monotonic() > deadline:
            return False
        for pid in moving:
            try:
                os.kill(pid, signal.SIGSTOP)
            except (ProcessLookupError, PermissionError):
                pass
        rounds += 1
        time.sleep(0 if rounds < 20 else 0.001)


def signal_all(root: int, sig: int = signal.SIGSTOP) -> None:
    """One pass of ``sig`` to every descendant of ``root`` (no waiting: :func:`stop_all` makes it sure)."""
    for pid in descendants(root):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def continue_all(root: int) -> None:
    """SIGCONT every descendant of ``root`` (the next call runs with what the last one left)."""
    signal_all(root, signal.SIGCONT)


def kill_until_gone(pids: Callable[[], list[int]], *, tries: int, pause_s: float) -> None:
    """SIGKILL every pid ``pids()`` lists until it lists none, ``tries`` rounds ``pause_s`` apart: a process
    may fork between the listing and the kill, so one round is not enough."""
    for _ in range(tries):
        found = pids()
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(pause_s)
