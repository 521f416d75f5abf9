"""Experiment trackers (``logging.trackers``): the run's parameters, and the set that fans each metrics
row out to every tracker without letting one of them stop training.

Why a wrapper around every call: a tracker is an observer of the run. A W&B network error, an MLflow
store on a full disk or a library bug must cost the run its dashboard, not its training. The first
failure of each tracker is said once (what raised, where); every failure is counted
(:attr:`TrackerSet.failures`), and the count is said again at close.
"""

from __future__ import annotations

import logging
import math
import subprocess
from pathlib import Path
from typing import Any

from unirl.config import RunConfig
from unirl.contracts import Tracker

log = logging.getLogger("unirl.trackers")


def run_params(config: RunConfig, kernel: Any) -> dict[str, str]:
    """What a tracker records as the run's parameters: every config field flattened to dotted keys,
    ``git_revision`` (of the directory the run was started in; ``none`` outside a git work tree, with
    ``+dirty`` when it has uncommitted changes) and ``version/<distribution>`` of every loaded plugin."""
    params: dict[str, str] = {}

    def flatten(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                flatten(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            params[prefix] = str(node)

    flatten("", config.model_dump(mode="json"))
    params["git_revision"] = git_revision(Path.cwd())
    for rec in getattr(kernel, "plugins", []):
        if rec.status == "loaded":
            params[f"version/{rec.dist}"] = rec.version
    return params


def git_revision(where: Path) -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "none"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "none"


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row, ``step`` excluded (it is the x axis)."""
    return {k: float(v) for k, v in metrics.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


class TrackerSet:
    """Every tracker of ``logging.trackers``, built through the kernel's ``trackers`` registry.

    A tracker that raises while it is built is reported and left out; one that raises in ``log``,
    ``log_artifact`` or ``close`` is reported the first time and counted every time, and keeps being
    called (a network blip should not lose the rest of the run's curves)."""

    def __init__(self, config: RunConfig, kernel: Any, run_dir: Path, *, resume_step: int | None = None,
                 params: dict[str, str] | None = None) -> None:
        self.failures: dict[str, int] = {}
        self.first_error: dict[str, str] = {}
        self.trackers: dict[str, Tracker] = {}
        self.closed = False
        if not config.logging.trackers:
            return
        params = run_params(config, kernel) if params is None else params
        for name in config.logging.trackers:
            self._guard(name, "start", lambda name=name: self.trackers.__setitem__(name, kernel.build(
                "trackers", name, config=config, run_dir=run_dir, params=params, resume_step=resume_step,
                options=config.logging.options.get(name, {}), options_at=f"logging.options.{name}")))

    def _guard(self, name: str, what: str, call: Any) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - any tracker failure is the finding; training goes on
            self.failures[name] = self.failures.get(name, 0) + 1
            if name not in self.first_error:
                self.first_error[name] = f"{type(exc).__name__}: {exc}"
                log.warning("tracker %s failed in %s (%s); training goes on, later failures of it are only "
                            "counted", name, what, self.first_error[name])

    def log(self, metrics: dict[str, Any]) -> None:
        row, step = numeric(metrics), int(metrics["step"])
        for name, tracker in self.trackers.items():
            self._guard(name, f"log (step {step})", lambda t=tracker: t.log(row, step))

    def log_artifact(self, path: Path) -> None:
        for name, tracker in self.trackers.items():
            self._guard(name, f"log_artifact ({path.name})", lambda t=tracker: t.log_artifact(path))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for name, tracker in self.trackers.items():
            self._guard(name, "close", tracker.close)
        for name, n in self.failures.items():
            log.warning("tracker %s failed %d time(s) in this run; first: %s", name, n, self.first_error[name])


class TensorBoardTracker(Tracker):
    """Core's tracker: scalars under ``RUN_DIR/tensorboard``.

    TensorBoard event files are append-only and cannot be cut; a resumed run passes ``resume_step`` (the
    first step it logs again) as ``SummaryWriter``'s ``purge_step``, which writes a marker that makes
    TensorBoard hide the older events at or past that step. The parameters go in as one text summary."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=self.resume_step)
        if self.resume_step is None:
            self.writer.add_text("params", "\n".join(f"    {k}: {v}" for k, v in sorted(self.params.items())), 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()
