"""Preemption: SIGTERM and SIGINT end a run at a step boundary, with a checkpoint.

Why: clusters preempt with SIGTERM and a grace period (Slurm, Kubernetes, spot instances), and a
Ctrl-C is the same request from a person. Dying mid-step loses every step since the last save. So the
first signal only *asks*: the loop finishes the step it is in, writes a checkpoint, flushes the metrics
and exits 143 (SIGTERM) or 130 (SIGINT). A second signal means "now": it raises at once (a checkpoint
being written is staged, so the last whole one stays intact). ``run.preempt_grace_s`` bounds the
wait: past it the run is interrupted without saving, and says so.

The handlers are installed only around the RL loop, in the main thread (Python delivers signals
there); before it (building the model, the SFT warm start) a signal stops the run as it always did.
"""

from __future__ import annotations

import _thread
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from unirl.kernel.errors import UniRLError

#: the shell's exit status of a process ended by each signal (128 + signal number)
EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}


class Preempted(UniRLError):
    """The run stopped on a signal at a step boundary (or past its grace); ``exit_code`` is 143 / 130."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Preemption:
    """The signal state of one run: ``requested`` (the first signal, or None) and the grace timer."""

    def __init__(self, grace_s: float, checkpoints: Path | None = None) -> None:
        self.grace_s, self.checkpoints = grace_s, checkpoints
        self.requested: signal.Signals | None = None
        self.at = 0.0
        self.expired = False
        self._timer: threading.Timer | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.requested, 143) if self.requested is not None else 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None:  # the second signal: stop now
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping at once")
        self.requested, self.at = signal.Signals(signum), time.monotonic()
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        """The grace is over and the step has not ended: interrupt the main thread (no save)."""
        self.expired = True
        _thread.interrupt_main()

    def stop_if_requested(self, step: int, checkpoint: Path | None, *, flush: Callable[[], None]) -> None:
        """At a step boundary, after the checkpoint: when a signal asked, flush and raise :class:`Preempted`."""
        if self.requested is None:
            return
        flush()
        where = f"checkpoint at {checkpoint}; resume with run.resume=true" if checkpoint is not None else \
            f"no new checkpoint (the save failed); {self.on_disk()}"
        raise Preempted(f"preempted at step {step} by {self.requested.name} after {time.monotonic() - self.at:.1f} s, "
                        f"{where}", self.exit_code)

    def on_disk(self) -> str:
        """What a resume would find, read from the disk now: the newest whole checkpoint, or that there is
        none (then a resume would fail, so the run must be started again)."""
        from unirl.actor.checkpoint import latest_checkpoint

        last = latest_checkpoint(self.checkpoints) if self.checkpoints is not None and self.checkpoints.is_dir() \
            else None
        if last is None:
            return "there is no checkpoint yet, so nothing to resume (start the run again, without run.resume)"
        return f"the last whole checkpoint is {last.name}; resume with run.resume=true"

    @contextmanager
    def installed(self) -> Iterator[Preemption]:
        """Handle SIGTERM and SIGINT inside the block (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in EXIT_CODES}
        try:
            yield self
        except KeyboardInterrupt as exc:
            if self.requested is None:
                raise
            why = (f"run.preempt_grace_s={self.grace_s:g} passed before the step ended" if self.expired
                   else str(exc) or "a second signal")
            raise Preempted(f"{self.requested.name}: {why}; exited without a new checkpoint; {self.on_disk()}",
                            self.exit_code) from exc
        finally:
            if self._timer is not None:
                self._timer.cancel()
            for s, handler in previous.items():
                signal.signal(s, handler)
