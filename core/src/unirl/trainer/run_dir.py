"""The run directory's life cycle: what a new run does with the directory an earlier one left, and which
checkpoint a resume loads.

Why this is decided before any model is built: ``run.resume=true`` with nothing to resume, or with only
corrupt checkpoints, is a mistake the user should hear about in a second, not after the engine started.

* ``run.resume: false``: a directory left by a run that never trained (it still holds the
  :data:`NOT_STARTED` marker, and only files a run writes) is replaced without ceremony; any other
  earlier run is kept, renamed. A non-empty directory that is no run directory at all is refused: it
  is the user's, and a run neither deletes nor moves it.
* ``run.resume: true``: continue from the newest whole checkpoint; none is an error naming the directory.
* ``run.resume: auto``: continue when there is a whole checkpoint, else start fresh; it says which.
* Resuming a checkpoint past ``trainer.steps`` is an error: there is nothing left to train, and a run
  that "resumed" would train nothing and say nothing. One exactly at ``trainer.steps`` (a finished run)
  says that it is complete.

A corrupt checkpoint (:func:`unirl.actor.checkpoint.checkpoint_problem`) is named with the file and the
reason, set aside as ``step_N.corrupt-<time>`` and the next older whole one is used.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from unirl.actor.checkpoint import checkpoint_steps, clean_checkpoint_root, resume_candidates, set_aside
from unirl.config import RunConfig
from unirl.kernel.errors import UniRLError
from unirl.outputs import OutputExistsError

#: written when a run directory is created, removed after the first training step (SFT or RL)
NOT_STARTED = "NOT_STARTED"
#: what a run (core, or a plugin shipped here) writes in its directory before its first step; a
#: never-started directory holding anything else is kept, renamed, not deleted
RUN_FILES = (NOT_STARTED, "config.yaml", "metrics.jsonl", ".metrics.jsonl.tmp-*", "tensorboard", "checkpoints",
             "curves.png", "hf", "hf.tmp-*", "hf.old-*", "eval-*.jsonl", ".eval-*.jsonl.tmp-*", "trace", "parity",
             "engine_init", "engine_init.tmp-*", "engine_init.old-*", "sglang_weights", "sglang_server_*.log",
             "wandb", "mlflow.db", "mlartifacts", "mlflow_run_id")
#: any one of these marks a directory a run wrote (an earlier run, kept renamed by a fresh one)
RUN_SIGNS = (NOT_STARTED, "config.yaml", "metrics.jsonl", "checkpoints")


class ResumeError(UniRLError):
    """``run.resume`` asks for a checkpoint the run directory does not have (exit 2, no traceback)."""


@dataclass
class RunDirPlan:
    """What :func:`prepare_run_dir` decided: the checkpoint to load (None: a fresh run) and what it said."""

    run_dir: Path
    checkpoint: Path | None = None
    notes: list[str] = field(default_factory=list)


def never_started(run_dir: Path) -> bool:
    """A directory a run created and left before its first training step (and no checkpoint since)."""
    return (run_dir / NOT_STARTED).is_file() and not checkpoint_steps(run_dir / "checkpoints")


def mark_started(run_dir: Path) -> None:
    """Called after the first training step: from now on the directory holds a run worth keeping."""
    (run_dir / NOT_STARTED).unlink(missing_ok=True)


def only_run_files(run_dir: Path) -> bool:
    """Everything in ``run_dir`` is something a run writes (:data:`RUN_FILES`)."""
    return all(any(fnmatch.fnmatchcase(p.name, pat) for pat in RUN_FILES) for p in run_dir.iterdir())


def check_steps_left(config: RunConfig, plan: RunDirPlan) -> None:
    """Raise :class:`ResumeError` when the checkpoint to resume is past ``trainer.steps``: the run would
    train nothing (a "2/1" bar) and say nothing; one at ``trainer.steps`` gets a note that the run is
    complete. The step is the one in the directory name."""
    m = re.match(r"step_(\d+)", plan.checkpoint.name) if plan.checkpoint is not None else None
    if m is None:
        return
    step, steps = int(m.group(1)), config.trainer.steps
    if step > steps:
        raise ResumeError(f"trainer.steps={steps} but the checkpoint to resume ({plan.checkpoint}) is at step "
                          f"{step}: there is nothing left to train (fix: raise trainer.steps above {step} to train "
                          "further, or set run.resume=false to start a fresh run)")
    if step == steps:  # a finished run resumed (e.g. run.resume=auto in a script): say so, train nothing
        plan.notes.append(f"the run in {config.run_dir} is complete (checkpoint {plan.checkpoint.name} is at "
                          f"trainer.steps={steps}): nothing to train; raise trainer.steps to train further")


def _fix(config: RunConfig) -> str:
    return (f"fix: drop run.resume to start fresh, use run.resume=auto (resume when there is a checkpoint, "
            f"else start fresh), or set run.name / run.output_dir to the run to continue (now {config.run_dir})")


def choose_checkpoint(config: RunConfig) -> RunDirPlan:
    """The checkpoint ``run.resume`` loads, with the corrupt ones set aside and named. Raises
    :class:`ResumeError` when ``run.resume`` is true and nothing whole is there, or when there are
    checkpoints but every one is corrupt (``auto`` included: starting fresh would bury them)."""
    run_dir, mode = config.run_dir, config.run.resume
    plan = RunDirPlan(run_dir)
    root = run_dir / "checkpoints"
    clean_checkpoint_root(root)  # first: a crash mid-save / mid-prune left leftovers (a moved-aside copy is restored)
    chosen, skipped = resume_candidates(root)
    if chosen is not None:
        for path, reason in skipped:  # set aside only when there is a whole one to go on from
            where = set_aside(path) if path.is_dir() else path
            plan.notes.append(f"skipped checkpoint {path.name}: {reason}"
                              + (f" (moved to {where.name})" if where != path else ""))
        plan.checkpoint = chosen
        plan.notes.append(f"resuming from {chosen}" + (" (run.resume=auto)" if mode == "auto" else ""))
        return plan
    if skipped:
        raise ResumeError(f"run.resume: no whole checkpoint in {root}: "
                          + "; ".join(f"{p.name}: {r}" for p, r in skipped)
                          + f"; fix: restore a checkpoint, or set run.resume=false to start fresh "
                            f"(the old directory {run_dir} is then kept, renamed)")
    if mode == "auto":
        plan.notes.append(f"run.resume=auto: no checkpoint in {run_dir}, starting fresh")
        return plan
    state = "a run that never trained" if never_started(run_dir) else (
        "no checkpoints/ directory" if run_dir.is_dir() else "it does not exist")
    raise ResumeError(f"run.resume=true but there is nothing to resume in {run_dir} ({state}); {_fix(config)}")


def prepare_run_dir(config: RunConfig, say: Callable[[str], None]) -> RunDirPlan:
    """Decide resume or fresh, make the directory, and mark it :data:`NOT_STARTED` when fresh."""
    run_dir, mode = config.run_dir, config.run.resume
    plan = RunDirPlan(run_dir)
    if mode:  # true or "auto"
        plan = choose_checkpoint(config)
        check_steps_left(config, plan)
    if plan.checkpoint is None and run_dir.exists() and not run_dir.is_dir():
        raise OutputExistsError(f"run.output_dir / run.name: {run_dir} is a file, not a run directory; it is left "
                                "untouched (fix: set run.name or run.output_dir to a new or empty directory)")
    if plan.checkpoint is None and run_dir.is_dir() and any(run_dir.iterdir()):
        if not any((run_dir / sign).exists() for sign in RUN_SIGNS):
            raise OutputExistsError(
                f"run.output_dir / run.name: {run_dir} holds files and is not a UniRL run directory (no "
                f"{', '.join(RUN_SIGNS)}); it is left untouched (fix: set run.name or run.output_dir to a new "
                "or empty directory)")
        if never_started(run_dir) and only_run_files(run_dir):  # a failed attempt: nothing worth keeping
            shutil.rmtree(run_dir)
            plan.notes.append(f"replaced {run_dir}, left by a run that never started training")
        else:  # a fresh run never mixes with (or deletes) an earlier one: the old directory is kept, renamed
            kept = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}")
            for i in range(1, 1000):
                if not kept.exists():
                    break
                kept = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}-{i}")
            run_dir.rename(kept)
            hint = (" (set run.resume=true to continue it instead)" if checkpoint_steps(kept / "checkpoints")
                    else " (it has no checkpoint to resume)")
            plan.notes.append(f"kept the previous run in {kept}{hint}")
    run_dir.mkdir(parents=True, exist_ok=True)
    if plan.checkpoint is None:
        (run_dir / NOT_STARTED).write_text(
            "This run stopped before its first training step. The next run with the same run.name replaces "
            "this directory.\n")
    for note in plan.notes:
        say(note)
    return plan
