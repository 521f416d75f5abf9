"""Checkpoints of a run: when one is written, what it holds, and how a resume reads it back.

Why a component: the loop asks ``should_save(step)`` and ``save(step, ...)``; the interval policy
(``trainer.save_every``, and always at the end of the process's work) and retention live here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unirl.actor.checkpoint import (
    CheckpointError,
    clean_checkpoint_root,
    latest_checkpoint,
    prune_checkpoints,
)
from unirl.config import RunConfig
from unirl.contracts import VersionLedger
from unirl.data.datasets import PromptCursor
from unirl.trainer.write_errors import guarded_write, tree_bytes


def save_state(c: Any, run_dir: Path, step: int, cursor: PromptCursor, ledger: VersionLedger,
               history: list[dict[str, Any]], *, keep_last: int = 0, keep_every: int = 0) -> Path:
    """One atomic checkpoint: the actor's state plus the trainer's (step, data cursor, version, history).

    The actor writes it to a temp dir, renames it into place and only then moves ``checkpoints/latest``,
    so a crash at any point leaves the previous checkpoint as the one a resume finds. Only then,
    retention (``trainer.keep_last`` / ``trainer.keep_every``) prunes the older ones, oldest first.
    """
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    state = {"step": step, "cursor": cursor.state_dict(), "version": ledger.version, "history": history,
             # e.g. a partial rollout's carried tail (its prompts left the cursor already); batch's is {}
             "controller": c.controller.state_dict()}
    c.actor.save(str(ckpt), extra=state)  # returns once committed and `latest` names it
    prune_checkpoints(run_dir / "checkpoints", keep_last=keep_last, keep_every=keep_every)
    return ckpt


def load_state(c: Any, run_dir: Path, checkpoint: Path | None = None) -> dict[str, Any] | None:
    """The trainer state of ``checkpoint`` (default: the one ``latest`` names), restoring the actor; None
    for a fresh run. :func:`unirl.trainer.run_dir.prepare_run_dir` chose ``checkpoint`` (corrupt ones skipped)."""
    root = run_dir / "checkpoints"
    if checkpoint is None:
        if not (root / "latest").is_file():
            return None
        clean_checkpoint_root(root)  # a crash mid-save / mid-prune left leftovers: finish or drop them
    target = str(checkpoint or root)
    try:
        return c.actor.load(target)
    except CheckpointError:
        raise
    except Exception as exc:  # whole files that do not fit this actor (e.g. a changed model.build)
        raise CheckpointError(f"checkpoint {target} cannot be restored ({type(exc).__name__}: {exc}); fix: resume "
                              f"with the config it was trained with ({run_dir / 'config.yaml'}), or set "
                              "run.resume=false to start fresh") from exc


class Checkpointer:
    """Writes the run's checkpoints on its own interval (``trainer.save_every``) and at ``end``."""

    def __init__(self, c: Any, config: RunConfig, run_dir: Path, end: int) -> None:
        self.c, self.config, self.run_dir, self.end = c, config, run_dir, end

    def should_save(self, done: int) -> bool:
        """After every ``trainer.save_every`` steps, and after the last step this process runs."""
        every = self.config.trainer.save_every
        return bool(every and done % every == 0) or done == self.end

    def save(self, done: int, cursor: PromptCursor, ledger: VersionLedger, history: list[dict[str, Any]]) -> Path | None:
        """The checkpoint of step ``done``; a failed write (disk full, EIO, permission) leaves the previous
        one and ``latest`` as they were, and fails the run or (``run.on_save_error: warn``) says so and
        returns None: the next interval retries."""
        t = self.config.trainer
        root = self.run_dir / "checkpoints"
        previous = latest_checkpoint(root) if (root / "latest").is_file() else None
        return guarded_write(
            lambda: save_state(self.c, self.run_dir, done, cursor, ledger, history, keep_last=t.keep_last,
                               keep_every=t.keep_every),
            on_error=self.config.run.on_save_error,
            path=root / f"step_{done:06d}", what="checkpoint",
            needed=tree_bytes(previous) if previous is not None else None,
            kept=f"the previous checkpoint {previous.name} is intact" if previous is not None else "no checkpoint yet")
