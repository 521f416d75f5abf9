"""Helpers for tests that run a UniRL driver in a subprocess and must prove it leaves nothing behind.

Why in core: the fault tests of several distributions (FSDP preemption, a vLLM replica lost mid-sync)
each start ``unirl train`` in a child process, so the pytest process never initialises Ray itself, and
then check that every process the run started (Ray's gcs_server and raylet, the ranks, the replicas)
ended with it. That check was written twice; a plugin's tests import it from here. Needs ``psutil``
(a dependency of Ray, which every such test uses). Not part of ``unirl.api``: nothing here serves a run.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def descendants(root: int) -> set[int]:
    """Every live process below ``root``."""
    import psutil

    try:
        return {p.pid for p in psutil.Process(root).children(recursive=True)}
    except psutil.Error:
        return set()


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run_watched(cmd: list[str], env: dict[str, str], cwd: Path, log: Path, *, timeout_s: float = 600,
                grace_s: float = 30) -> tuple[int, str, int]:
    """Run ``cmd`` to its end (output to ``log``), noting every process it starts; then assert none of
    them outlives it by more than ``grace_s`` (Ray's processes end with their driver, not at the same
    instant). Only this run's processes are counted, not other jobs' on a shared machine. Returns the
    exit code, the output and the driver's pid."""
    seen: set[int] = set()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                seen |= descendants(proc.pid)
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    text = log.read_text()
    deadline = time.monotonic() + grace_s
    while any(alive(p) for p in seen) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = sorted(p for p in seen if alive(p))
    assert not left, f"processes {left} outlived their driver: {text[-2000:]}"
    assert seen, "the run started no process (no Ray?)"
    return proc.returncode, text, proc.pid
