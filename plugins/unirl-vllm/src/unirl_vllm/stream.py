"""One streamed weight sync session over every replica: buckets go to vLLM as they are staged.

Why streamed: the FSDP actor already sends its weights in ``bucket_mb`` buckets; staging the whole set
before loading it (and keeping it for recovery) held one or two extra copies of the model in the
trainer's process. Here each bucket is checked (:class:`unirl.api.Staged` with ``keep=False``: names,
shapes, dtype, NaN/Inf, duplicates), fingerprinted (:class:`unirl.api.Fingerprint`, the same digest
:func:`unirl.api.fingerprint` gives the whole list), loaded into every replica and dropped, so the
trainer holds about two buckets at once, not a model.

It stays **one** reload session per replica (``unirl_sync_begin`` / ``unirl_sync_load``\\* /
``unirl_sync_finish``, :mod:`unirl_vllm.extension`): several reload calls would corrupt fused q/k/v
across a bucket boundary (platform note, trap 4). The session begins with the first bucket, so a payload
whose first bucket is bad never touches vLLM. A tensor that fails its checks later arrives after good
ones were loaded: the engine then aborts the session and reloads the last committed version
(:mod:`unirl_vllm.committed`).

How each bucket reaches a replica (:mod:`unirl.sync.transport`): the tensors themselves (``inprocess``),
one tmpfs file per bucket shared by the replicas on this node (``shm``), or one Ray object-store put
shared by the replicas elsewhere (``object_store``). With Ray replicas the next bucket is staged while
the replicas load the current one (one load in flight).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unirl.api import Fingerprint, Staged

if TYPE_CHECKING:  # pragma: no cover
    import torch

Bucket = list[tuple[str, "torch.Tensor"]]


def checked(staged: Staged, named: Iterable[tuple[str, torch.Tensor]], sent: Fingerprint
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of ``named`` as the engine names it, checked and copied by ``staged`` (which must not
    keep them), and folded into the sender's fingerprint ``sent`` as it passes."""
    for name, tensor in named:
        for wire, copy in staged.add_all(name, tensor):
            sent.update(wire, copy)
            yield wire, copy


class shm_file:  # noqa: N801 - used as a context manager
    """A safetensors file of one bucket on tmpfs, removed on exit; tensor order kept in metadata."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.path = ""

    def __enter__(self) -> str:
        from safetensors.torch import save_file

        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="unirl-sync-", suffix=".safetensors", dir=root)
        os.close(fd)
        save_file(dict(self.bucket), self.path, metadata={"order": "\n".join(n for n, _ in self.bucket)})
        return self.path

    def __exit__(self, *exc: object) -> None:
        if self.path:
            Path(self.path).unlink(missing_ok=True)


class SyncSession:
    """One sync session on every replica at once (``hosts``: in-process ``Host`` or Ray ``RayHost``).

    :meth:`load` begins the session on the first bucket; :meth:`finish` returns every worker's receipt,
    renumbered across replicas; :attr:`begun` says whether any replica may have been touched."""

    def __init__(self, hosts: list[Any], transports: list[str], version: int, *, ray: bool,
                 kept: frozenset[str] = frozenset()) -> None:
        self.hosts, self.transports, self.version = hosts, transports, int(version)
        self.kept = sorted(kept)  # engine names left out on purpose: each worker's completeness check skips them
        self.ray = ray  # Ray replicas answer through refs, so a bucket's load overlaps the next one's staging
        self.begun = False
        self._pending: list[Any] | None = None  # the Ray refs of the bucket being loaded
        self._carriers: list[Any] = []  # its tmpfs file and object-store ref, dropped once loaded

    def _start(self, method: str, args: list[tuple]) -> list[Any]:
        if self.ray:
            return [h.remote(method, *a) for h, a in zip(self.hosts, args, strict=True)]
        return [getattr(h, method)(*a) for h, a in zip(self.hosts, args, strict=True)]

    def _wait(self, started: list[Any], what: str) -> list[Any]:
        if self.ray:
            return [h.result(ref, what) for h, ref in zip(self.hosts, started, strict=True)]
        return started

    def _drain(self) -> None:
        """Wait for the bucket in flight, then drop its carriers."""
        try:
            if self._pending is not None:
                pending, self._pending = self._pending, None
                self._wait(pending, "sync")
        finally:
            for c in self._carriers:
                if isinstance(c, shm_file):
                    c.__exit__(None, None, None)
            self._carriers = []

    def load(self, bucket: Bucket) -> None:
        """Send one bucket to every replica (after the previous one was loaded)."""
        if not self.begun:
            self.begun = True
            self._wait(self._start("sync_begin", [(self.version, self.kept)] * len(self.hosts)), "sync")
        carried: dict[str, Any] = {"inprocess": bucket}
        carriers: list[Any] = []
        if "shm" in self.transports:
            f = shm_file(bucket)
            carriers.append(f)
            carried["shm"] = f.__enter__()
        if "object_store" in self.transports:
            import ray

            carried["object_store"] = ray.put(bucket)  # a top-level ref: Ray hands the replica the bucket
            carriers.append(carried["object_store"])
        try:
            self._drain()
        finally:
            self._carriers = carriers
        started = self._start("sync_load", [(carried[t],) for t in self.transports])
        self._pending = started
        if not self.ray:
            self._drain()

    def finish(self) -> list[dict[str, Any]]:
        """Wait for the last bucket, finish every replica's session; the receipts, numbered in order."""
        self._drain()
        if not self.begun:  # an empty stream still opens (and validates) the session
            self.begun = True
            self._wait(self._start("sync_begin", [(self.version, self.kept)] * len(self.hosts)), "sync")
        answers = self._wait(self._start("sync_finish", [(t,) for t in self.transports]), "sync")
        receipts: list[dict[str, Any]] = []
        for part in answers:
            for r in part:
                receipts.append({**r, "worker": len(receipts)})
        return receipts

    def abort(self) -> None:
        """Leave the session on every replica (best effort: a lost replica cannot answer)."""
        try:
            self._drain()
        except Exception:  # noqa: BLE001 - the failure being handled is what matters
            pass
        if self.begun:
            self._wait(self._start("sync_abort", [()] * len(self.hosts)), "sync")
