"""A step's phases (``rollout``, ``replay``, ``train``, ``sync``): each one timed into the step's metrics
(``rollout_s`` ...) and marked as a ``torch.profiler`` range (``unirl.rollout`` ...), in one place.

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

from torch.profiler import record_function

#: what runs around every phase while :func:`observed` is active; ``None`` the rest of the time
_observer: Callable[[str], AbstractContextManager[object]] | None = None


@contextlib.contextmanager
def phase(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Time the block into ``timings[name + "_s"]`` and mark it as the profiler range ``unirl.<name>``."""
    t0 = time.perf_counter()
    around = _observer(name) if _observer is not None else contextlib.nullcontext()
    with around, record_function(f"unirl.{name}"):
        yield
    timings[f"{name}_s"] = time.perf_counter() - t0


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
