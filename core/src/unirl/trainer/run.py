"""What one training attempt holds (:class:`Run`) and what it returns (:class:`TrainResult`).

Why a module of its own: the loop (:mod:`unirl.trainer.loop`) decides what happens when, and the run's
end (:mod:`unirl.trainer.run_end`) reads the same two objects; both import them from here, so neither
imports the other.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unirl.config import RunConfig
from unirl.contracts import VersionLedger
from unirl.kernel.manager import Kernel
from unirl.mismatch.monitor import MismatchMonitor
from unirl.trainer.components import Components
from unirl.trainer.memory import MemoryRecorder
from unirl.trainer.report import say


@dataclass
class TrainResult:
    run_dir: Path
    eval_before: float = math.nan
    eval_after: float = math.nan
    steps_done: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    plot: Path | None = None
    restarts: int = 0  # run.max_restarts used (restarts.log in the run directory says why)

    def state_dict(self) -> list[dict[str, Any]]:
        """The checkpoint's ``history``: every row so far (a resume cuts metrics.jsonl back to it)."""
        return self.history

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        self.history = state


@dataclass
class Run:
    """What one training attempt holds: the config, the kernel, the components (built once, frozen) and
    the run's own state, which changes as it goes and so lives here, not on the components."""

    config: RunConfig
    kernel: Kernel
    c: Components
    run_dir: Path
    ledger: VersionLedger = field(default_factory=VersionLedger)
    start: int = 0
    resumed: bool = False
    t_start: float = field(default_factory=time.perf_counter)
    #: metrics of phases outside a step (load, resume, the first sync, a checkpoint), for the next row
    pending: dict[str, Any] = field(default_factory=dict)
    memory: MemoryRecorder | None = None
    #: the batch the last step trained on (a non-finite update's debug bundle holds it)
    last_batch: list[Any] = field(default_factory=list)
    #: the error of the latest failed training sample (trainer.max_failed_frac's stop message quotes it)
    failure_example: str | None = None
    #: the train-inference mismatch diagnostics (unirl.mismatch), from before the first publish
    mismatch: MismatchMonitor | None = None
    tracer_closed: bool = False  # finish() closed the tracer (a crashed attempt closes it on the way out)

    def say(self, text: str) -> None:
        say(self.config, text)

    def take_pending(self) -> dict[str, Any]:
        taken, self.pending = self.pending, {}
        return taken


def export_model(c: Components, out: Path) -> None:
    """The trained policy as a plain HF directory (what ``unirl export`` writes from a checkpoint)."""
    from unirl.export import finish_hf_dir

    c.actor.export_hf(str(out))
    finish_hf_dir(out, c.tokenizer)
