"""A run's phases (``load``, ``rollout``, ``replay``, ``train``, ``sync``, ``checkpoint``, ``export``): each one
timed into the step's metrics (``rollout_s`` ...), marked as a ``torch.profiler`` range (``unirl.rollout``
...) and, while a run records it (:func:`recording`), measured for peak memory (``mem/rollout_peak_mb`` ...:
:mod:`unirl.trainer.memory`), in one place.

Why one function: the seconds a user reads in the metrics and the ranges a profile shows must cover the
same code, and a tool that watches one phase needs one place to do it. ``benchmarks/step_profile.py
--phase`` turns the profiler on for one phase of the last step only, through :func:`observed`: the
whole 100 M x 1024 step under the profiler records ~4.5 M events, more than the machine's memory holds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from torch.profiler import record_function

if TYPE_CHECKING:  # pragma: no cover
    from unirl.trainer.memory import MemoryRecorder

#: what runs around every phase while :func:`observed` is active; ``None`` the rest of the time
_observer: Callable[[str], AbstractContextManager[object]] | None = None
#: the run's per-phase memory recorder while :func:`recording` is active
_recorder: MemoryRecorder | None = None


@contextlib.contextmanager
def phase(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Time the block into ``timings[name + "_s"]`` and mark it as the profiler range ``unirl.<name>``;
    while a run records memory, its peaks go into ``timings`` too (``mem/<name>_peak_mb`` ...)."""
    recorder = _recorder
    if recorder is not None:  # outside the timer: asking the ranks for their peaks is not the phase's time
        recorder.begin(name)
    try:
        t0 = time.perf_counter()
        around = _observer(name) if _observer is not None else contextlib.nullcontext()
        with around, record_function(f"unirl.{name}"):
            yield
        timings[f"{name}_s"] = time.perf_counter() - t0
    except BaseException:
        if recorder is not None:
            recorder.abandon(name)
        raise
    if recorder is not None:
        timings.update(recorder.end(name))


@contextlib.contextmanager
def observed(around: Callable[[str], AbstractContextManager[object]]) -> Iterator[None]:
    """Within this block, every phase runs inside ``around(name)`` (inside its timer, outside its range).

    One observer at a time: a second one nested inside would hide the first, so it is refused."""
    global _observer
    if _observer is not None:
        raise RuntimeError("unirl.trainer.phases.observed: an observer is already active; nest none inside another")
    _observer = around
    try:
        yield
    finally:
        _observer = None


@contextlib.contextmanager
def recording(recorder: MemoryRecorder) -> Iterator[MemoryRecorder]:
    """Within this block, every phase's peak memory is measured by ``recorder`` (one run attempt's)."""
    global _recorder
    if _recorder is not None:
        raise RuntimeError("unirl.trainer.phases.recording: a memory recorder is already active")
    _recorder = recorder
    try:
        yield recorder
    finally:
        _recorder = None
