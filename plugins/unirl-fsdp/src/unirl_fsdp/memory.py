"""A rank's side of the per-phase memory report (:meth:`unirl.api.Actor.memory_peaks`).

Why in the rank: each rank is a Ray actor in a process of its own, so only the rank can read its own
high-water mark. The trainer asks every rank at each phase's end (:mod:`unirl.trainer.memory`); each
answers with its peak since it last answered (the first answer covers the rank's start: the model's load)
and restarts its mark. The driver-side actor gathers the answers in rank order.
"""

from __future__ import annotations

from typing import Any

from unirl.api import MemoryPeak, process_meter


def rank_peak() -> MemoryPeak:
    """This rank's peak RSS (and CUDA peak, on a GPU) since it last answered, mark reset."""
    return process_meter().take()


def group_peaks(group: Any) -> list[MemoryPeak]:
    """Every rank's :func:`rank_peak`, in rank order (one round trip to all ranks at once)."""
    return list(group.call("memory_peaks"))
