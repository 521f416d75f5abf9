"""Checkpoints of a run: when one is written, what it holds, and how a resume reads it back.

Why a component: the loop asks ``should_save(step)`` and ``save(step)``; the interval policy
(``trainer.save_every``, and always at the end of the process's work) and retention live here.
Like TorchTitan's ``CheckpointManager(states=...)``, it is handed the run's stateful parts by name
(the data cursor, the served version, the history, the rollout driver) and asks each for its
``state_dict()`` / ``load_state_dict()``; it reaches into nothing else. The file's trainer state is
``{"step": ..., name: part.state_dict(), ...}``, so the names are the checkpoint format
(``cursor``, ``version``, ``history``, ``controller``) and stay as they were.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from unirl.actor.checkpoint import (
    CheckpointError,
    clean_checkpoint_root,
    latest_checkpoint,
    prune_checkpoints,
)
from unirl.config import RunConfig
from unirl.contracts import Actor, VersionLedger
from unirl.trainer.write_errors import guarded_write, tree_bytes


class Stateful(Protocol):
    """A part of the run a checkpoint holds: what it saves, and how it takes that back on resume."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class ServedVersion:
    """The ledger's version as a checkpoint holds it (an int, the format's ``version``). On resume the
    ledger is set one below: the first publish of the fresh engine serves the checkpoint's weights and
    bumps it back to the version they had."""

    def __init__(self, ledger: VersionLedger) -> None:
        self.ledger = ledger

    def state_dict(self) -> int:
        return self.ledger.version

    def load_state_dict(self, state: int) -> None:
        self.ledger.version = int(state) - 1


def save_state(actor: Actor, run_dir: Path, step: int, states: dict[str, Stateful], *, keep_last: int = 0,
               keep_every: int = 0) -> Path:
    """One atomic checkpoint: the actor's state plus the trainer's (step, and each stateful part's).

    The actor writes it to a temp dir, renames it into place and only then moves ``checkpoints/latest``,
    so a crash at any point leaves the previous checkpoint as the one a resume finds. Only then,
    retention (``trainer.keep_last`` / ``trainer.keep_every``) prunes the older ones, oldest first.
    """
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    state = {"step": step, **{name: part.state_dict() for name, part in states.items()}}
    actor.save(str(ckpt), extra=state)  # returns once committed and `latest` names it
    prune_checkpoints(run_dir / "checkpoints", keep_last=keep_last, keep_every=keep_every)
    return ckpt


def load_state(actor: Actor, run_dir: Path, checkpoint: Path | None = None) -> dict[str, Any] | None:
    """The trainer state of ``checkpoint`` (default: the one ``latest`` names), restoring the actor; None
    for a fresh run. :func:`unirl.trainer.run_dir.prepare_run_dir` chose ``checkpoint`` (corrupt ones skipped)."""
    root = run_dir / "checkpoints"
    if checkpoint is None:
        if not (root / "latest").is_file():
            return None
        clean_checkpoint_root(root)  # a crash mid-save / mid-prune left leftovers: finish or drop them
    target = str(checkpoint or root)
    try:
        return actor.load(target)
    except CheckpointError:
        raise
    except Exception as exc:  # whole files that do not fit this actor (e.g. a changed model.build)
        raise CheckpointError(f"checkpoint {target} cannot be restored ({type(exc).__name__}: {exc}); fix: resume "
                              f"with the config it was trained with ({run_dir / 'config.yaml'}), or set "
                              "run.resume=false to start fresh") from exc


class Checkpointer:
    """Writes the run's checkpoints on its own interval (``trainer.save_every``) and at ``end``, from the
    stateful parts it was handed, and restores them on resume.

    A part built after the resume (the rollout driver: its window starts at the version the first
    publish serves) is :meth:`add`-ed later and gets its saved state then."""

    def __init__(self, actor: Actor, config: RunConfig, run_dir: Path, states: dict[str, Stateful]) -> None:
        self.actor, self.config, self.run_dir = actor, config, run_dir
        self.states = dict(states)
        self.end = config.trainer.steps
        self._held: dict[str, Any] = {}  # restored state of parts not added yet

    def add(self, name: str, part: Stateful) -> None:
        """One more stateful part; it gets its state from the checkpoint the run resumed from, if any."""
        self.states[name] = part
        if name in self._held:
            part.load_state_dict(self._held.pop(name))

    def load(self, checkpoint: Path | None) -> int | None:
        """Restore ``checkpoint`` (the actor and every part, those added later on :meth:`add`); returns its
        step, or None for a fresh run (``checkpoint`` None)."""
        if checkpoint is None:
            return None
        state = load_state(self.actor, self.run_dir, checkpoint)
        if state is None:
            return None
        for name, value in state.items():
            if name in self.states:
                self.states[name].load_state_dict(value)
            elif name != "step":
                self._held[name] = value
        return int(state["step"])

    def should_save(self, done: int) -> bool:
        """After every ``trainer.save_every`` steps, and after the last step this process runs."""
        every = self.config.trainer.save_every
        return bool(every and done % every == 0) or done == self.end

    def save(self, done: int) -> Path | None:
        """The checkpoint of step ``done``; a failed write (disk full, EIO, permission) leaves the previous
        one and ``latest`` as they were, and fails the run or (``run.on_save_error: warn``) says so and
        returns None: the next interval retries."""
        t = self.config.trainer
        root = self.run_dir / "checkpoints"
        previous = latest_checkpoint(root) if (root / "latest").is_file() else None
        return guarded_write(
            lambda: save_state(self.actor, self.run_dir, done, self.states, keep_last=t.keep_last,
                               keep_every=t.keep_every),
            on_error=self.config.run.on_save_error,
            path=root / f"step_{done:06d}", what="checkpoint",
            needed=tree_bytes(previous) if previous is not None else None,
            kept=f"the previous checkpoint {previous.name} is intact" if previous is not None else "no checkpoint yet")
