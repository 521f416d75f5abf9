"""Where the last committed weights live, so that a failed sync can put them back.

A streamed sync (:mod:`unirl_vllm.stream`) loads buckets into vLLM before it knows the whole payload is
good: a NaN in the last tensor, a missing tensor, a receipt that does not match or a lost replica is
found after earlier buckets replaced weights. The engine then reloads the version it last committed,
streamed in buckets like any sync, from one of:

* the start-up checkpoint (the engine's model directory) until a sync was committed;
* by default, an on-disk copy: each sync writes the buckets it sends to
  ``<run_dir>/engine_committed/<pid>-<n>/pending`` as it sends them, and a commit renames that to
  ``current`` (so the disk holds one committed version, plus the one being written). No copy of the
  model stays in the trainer's memory;
* with ``rollout.options.keep_committed_copy: true``, the staged tensors kept in memory (one whole copy
  in the trainer's process, no disk writes: the behaviour before syncs were streamed).

The copy holds exactly the tensors the committed sync sent, in order, so reloading it gives receipts
with the committed fingerprint, which the engine checks.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from unirl.api import weight_buckets

if TYPE_CHECKING:  # pragma: no cover
    import torch

Bucket = list[tuple[str, "torch.Tensor"]]
_ids = itertools.count()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CommittedCopy:
    """The recovery source of one engine: the start-up checkpoint, then each committed sync's copy."""

    def __init__(self, startup_dir: str, dtype: str, root: Path | None) -> None:
        """``root``: the directory of on-disk copies (one sub-directory per engine); None: keep in memory."""
        self.startup_dir, self.dtype = startup_dir, dtype
        self.fingerprint: str | None = None  # of the committed copy; None while it is the start-up checkpoint
        self.kept: frozenset[str] = frozenset()  # what the committed sync left out (held unchanged, not copied)
        self._memory: list[Bucket] | None = None
        self._dir: Path | None = None
        if root is not None:
            self._dir = root / f"{os.getpid()}-{next(_ids)}"
            self._clean_stale(root)

    @staticmethod
    def _clean_stale(root: Path) -> None:
        """Remove copies left by engines whose process is gone (a killed run); they are never read again."""
        if not root.is_dir():
            return
        for d in root.iterdir():
            pid = d.name.split("-")[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------ writing one sync's copy
    def writer(self) -> _Writer:
        return _Writer(self._dir / "pending" if self._dir is not None else None)

    def commit(self, writer: _Writer, fingerprint: str, kept: frozenset[str] = frozenset()) -> None:
        """The sync that ``writer`` copied was committed: its copy becomes the recovery source. ``kept``:
        the names it left out, which a failed later sync cannot have touched either (it leaves out the
        same ones), so reloading the copy with them kept restores the whole committed version."""
        if self._dir is None:
            self._memory = writer.kept
        else:
            current = self._dir / "current"
            shutil.rmtree(current, ignore_errors=True)
            writer.path.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
            writer.path.rename(current)  # type: ignore[union-attr]
        self.fingerprint = fingerprint
        self.kept = kept

    # ------------------------------------------------------------------ reading it back
    def buckets(self, limit: int) -> Iterator[Bucket]:
        """The committed version, one bucket at a time (at most ``limit`` bytes, or one tensor)."""
        if self.fingerprint is None:
            yield from weight_buckets(self._startup_tensors(), limit)
        elif self._memory is not None:
            yield from self._memory
        else:
            yield from self._disk_buckets(self._dir / "current")  # type: ignore[operator]

    def _startup_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        import torch
        from safetensors import safe_open

        dtype = getattr(torch, self.dtype.removeprefix("torch."))
        for f in sorted(Path(self.startup_dir).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, handle.get_tensor(name).to(dtype)

    @staticmethod
    def _disk_buckets(path: Path) -> Iterator[Bucket]:
        from safetensors import safe_open

        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as handle:
                order = (handle.metadata() or {}).get("order", "")
                names = order.split("\n") if order else list(handle.keys())
                yield [(n, handle.get_tensor(n)) for n in names]

    def close(self) -> None:
        self._memory = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class _Writer:
    """The copy of one sync as its buckets pass: files under ``path``, or the buckets kept in memory."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.kept: list[Bucket] = []
        self._n = 0
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)  # a sync that failed before it was discarded

    def add(self, bucket: Bucket) -> None:
        if self.path is None:
            self.kept.append(bucket)
            return
        from safetensors.torch import save_file

        self.path.mkdir(parents=True, exist_ok=True)
        save_file(dict(bucket), str(self.path / f"{self._n:06d}.safetensors"),
                  metadata={"order": "\n".join(n for n, _ in bucket)})
        self._n += 1

    def discard(self) -> None:
        self.kept = []
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)


__all__ = ["CommittedCopy"]

