"""Each phase's peak memory, in the trainer's process and in each of the actor's own processes (its ranks).

Why here: :func:`unirl.trainer.phases.phase` already brackets every phase of a run (load, rollout,
replay, train, sync, checkpoint, export), so the recorder installed there (:func:`unirl.trainer.phases.recording`)
sees each one begin and end. At a phase's end it takes the trainer's own peak
(:func:`unirl.memory.process_meter`) and asks the actor for its processes' peaks since it last asked
(:meth:`unirl.contracts.Actor.memory_peaks`: an FSDP actor's ranks; the embedded actor runs in the
trainer's process and reports none of its own).

The phase's metrics (``mem/<phase>_peak_mb`` for the trainer, ``mem/<phase>_peak_mb_rank<k>`` and
``mem/<phase>_peak_mb_ranks_sum`` for the ranks, ``..._cuda_...`` on a GPU) go into the step's row; the
run keeps each phase's maximum for the closing table and ``RUN_DIR/memory.json``.

A phase that opens inside another one resets the process's high-water mark: what the outer one had
reached so far is folded into it first, so nesting loses nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unirl.memory import MemoryPeak, PeakMeter, process_meter

MEMORY_FILE = "memory.json"


def _max(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


@dataclass
class PhasePeak:
    """One phase's peaks (MiB): the trainer's and each rank's, RSS and CUDA (None where not measured)."""

    rss_mb: float = 0.0
    cuda_mb: float | None = None
    ranks_rss_mb: list[float] = field(default_factory=list)
    ranks_cuda_mb: list[float | None] = field(default_factory=list)

    def fold(self, own: MemoryPeak | None, ranks: list[MemoryPeak]) -> None:
        """Raise each peak to what ``own`` (the trainer's) and ``ranks`` (in rank order) reached."""
        if own is not None:
            self.rss_mb, self.cuda_mb = max(self.rss_mb, own.rss_mb), _max(self.cuda_mb, own.cuda_mb)
        for k, p in enumerate(ranks):
            if k == len(self.ranks_rss_mb):
                self.ranks_rss_mb.append(0.0)
                self.ranks_cuda_mb.append(None)
            self.ranks_rss_mb[k] = max(self.ranks_rss_mb[k], p.rss_mb)
            self.ranks_cuda_mb[k] = _max(self.ranks_cuda_mb[k], p.cuda_mb)

    def merge(self, other: PhasePeak) -> None:
        """The maximum of two occurrences of a phase (the run's table)."""
        self.fold(MemoryPeak(other.rss_mb, other.cuda_mb), [MemoryPeak(r, c) for r, c in
                                                             zip(other.ranks_rss_mb, other.ranks_cuda_mb, strict=True)])

    def metrics(self, name: str) -> dict[str, float]:
        """The phase's keys in a metrics row, MiB to 0.1."""
        out = {f"mem/{name}_peak_mb": round(self.rss_mb, 1)}
        if self.cuda_mb is not None:
            out[f"mem/{name}_cuda_peak_mb"] = round(self.cuda_mb, 1)
        for k, rss in enumerate(self.ranks_rss_mb):
            out[f"mem/{name}_peak_mb_rank{k}"] = round(rss, 1)
            if self.ranks_cuda_mb[k] is not None:
                out[f"mem/{name}_cuda_peak_mb_rank{k}"] = round(self.ranks_cuda_mb[k], 1)
        if self.ranks_rss_mb:
            out[f"mem/{name}_peak_mb_ranks_sum"] = round(sum(self.ranks_rss_mb), 1)
        return out


class MemoryRecorder:
    """Installed around a run's phases (:func:`unirl.trainer.phases.recording`); one per run attempt."""

    def __init__(self, meter: PeakMeter | None = None) -> None:
        self.meter = meter or process_meter()
        self.actor: Any = None  # attached once built (the load phase's end asks it for its ranks' peaks)
        self.open: list[tuple[str, PhasePeak]] = []
        self.table: dict[str, PhasePeak] = {}

    def attach(self, actor: Any) -> None:
        self.actor = actor

    def begin(self, name: str) -> None:
        """A phase opens: what open phases reached so far is theirs, then the mark restarts from now."""
        own = self.meter.take()
        for _, peak in self.open:
            peak.fold(own, [])
        self.open.append((name, PhasePeak()))

    def end(self, name: str) -> dict[str, float]:
        """The phase closes: its peaks (the trainer's, the actor's ranks') as metrics, kept in the table."""
        own = self.meter.take()
        ranks = list(self.actor.memory_peaks()) if self.actor is not None else []
        for _, peak in self.open:
            peak.fold(own, ranks)
        opened, peak = self.open.pop()
        assert opened == name, f"memory phases closed out of order: {opened!r} open, {name!r} closed"
        self.table.setdefault(name, PhasePeak()).merge(peak)
        return peak.metrics(name)

    def abandon(self, name: str) -> None:
        """The phase raised: nothing to report, but it is no longer open."""
        if self.open and self.open[-1][0] == name:
            self.open.pop()

    def write(self, run_dir: Path) -> Path:
        """``RUN_DIR/memory.json``: each phase's maximum over the run (MiB), and how RSS was measured."""
        doc = {"method": self.meter.method,
               "phases": {name: {"trainer_rss_mb": round(p.rss_mb, 1), "trainer_cuda_mb": p.cuda_mb,
                                 "ranks_rss_mb": [round(r, 1) for r in p.ranks_rss_mb],
                                 "ranks_cuda_mb": p.ranks_cuda_mb} for name, p in self.table.items()}}
        path = run_dir / MEMORY_FILE
        path.write_text(json.dumps(doc, indent=1) + "\n")
        return path
