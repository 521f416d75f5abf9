"""A process's peak memory since it was last asked: resident set (RSS) and, on a GPU, the CUDA allocator's peak.

Why a meter of its own: the question a user asks of a run that ran out of memory is *which phase* peaked
(loading, the rollout, the replay, the update, the weight sync, the checkpoint, the export) and *in which
process* (the trainer, or one of the FSDP ranks). Each process (the trainer's, each rank's) owns one meter,
:func:`process_meter`, and a phase's peak is what :meth:`PeakMeter.take` returns at its end.

How the peak is found, on Linux: the kernel keeps the process's RSS high-water mark (``VmHWM`` in
``/proc/self/status``), and writing ``5`` to ``/proc/self/clear_refs`` resets it to the current RSS. So
:meth:`take` reads the mark and resets it: exact, free, nothing polls. Where ``clear_refs`` cannot be
written (another OS, a locked-down container), a daemon thread samples the RSS every ``interval_s``
(``method == "sampled"``: a peak shorter than the interval can be missed). CUDA's peak comes from
``torch.cuda.max_memory_allocated`` (reset with ``reset_peak_memory_stats``), only in a process that
already uses CUDA (a meter never initialises a device).

A process has one mark, so it has one meter: two meters resetting the same mark would each see only
part of the other's phase.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

MB = 1 << 20
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass(frozen=True)
class MemoryPeak:
    """One process's peaks (MiB) over an interval: RSS, and the CUDA allocator's (None off the GPU)."""

    rss_mb: float
    cuda_mb: float | None = None
    method: str = "hwm"  # "hwm": the kernel's high-water mark; "sampled": a polling thread's maximum


def _status_kb(field: str) -> int | None:
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(m.group(1)) if m else None


def current_rss_mb() -> float:
    """The process's resident set now (MiB)."""
    kb = _status_kb("VmRSS")
    if kb is not None:
        return kb / 1024
    import psutil

    return psutil.Process().memory_info().rss / MB


def _can_clear() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return _status_kb("VmHWM") is not None


class PeakMeter:
    """A process's peak memory since the last :meth:`take` (the first covers everything since start)."""

    def __init__(self, *, interval_s: float = 0.01, force_sampling: bool = False) -> None:
        self._lock = threading.Lock()
        self._sampled_max = max(current_rss_mb(), (_status_kb("VmHWM") or 0) / 1024)
        before = _status_kb("VmHWM")  # the mark since start: testing clear_refs resets it
        self._carry = before / 1024 if before is not None else 0.0
        self.method = "sampled" if force_sampling or not _can_clear() else "hwm"
        self._stop = threading.Event()
        if self.method == "sampled":
            self._interval_s = interval_s
            threading.Thread(target=self._sample, name="unirl-memory-sampler", daemon=True).start()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            rss = current_rss_mb()
            with self._lock:
                self._sampled_max = max(self._sampled_max, rss)

    def close(self) -> None:
        """Stop the sampling thread (a no-op for the high-water mark)."""
        self._stop.set()

    def peek(self) -> float:
        """The RSS peak since the last :meth:`take`, without resetting it (MiB)."""
        if self.method == "hwm":
            kb = _status_kb("VmHWM")
            return max(self._carry, kb / 1024 if kb is not None else current_rss_mb())
        with self._lock:
            return max(self._sampled_max, current_rss_mb())

    def take(self) -> MemoryPeak:
        """The peaks since the last call, then reset both to what the process holds now."""
        rss = self.peek()
        if self.method == "hwm":
            _CLEAR_REFS.write_text("5")
            self._carry = 0.0
        else:
            with self._lock:
                self._sampled_max = current_rss_mb()
        return MemoryPeak(rss_mb=rss, cuda_mb=_take_cuda(), method=self.method)


def _take_cuda() -> float | None:
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    peak = torch.cuda.max_memory_allocated() / MB
    torch.cuda.reset_peak_memory_stats()
    return peak


_meter: PeakMeter | None = None
_meter_lock = threading.Lock()


def process_meter() -> PeakMeter:
    """This process's one meter (built on first use: its first :meth:`PeakMeter.take` covers everything
    since the process started, loading included)."""
    global _meter
    with _meter_lock:
        if _meter is None:
            _meter = PeakMeter()
        return _meter
