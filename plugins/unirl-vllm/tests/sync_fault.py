"""A vLLM worker extension for the sync-fault test only: UniRL's own, plus a SIGKILL of its process in the
middle of one weight sync (``test_vllm_sync_fault.py``).

Why an extension and not a fault point in the plugin: the recipe selects it through
``rollout.options.engine_args.worker_extension_cls`` (applied last), so production code holds no test
logic. With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the worker runs in the replica's Ray actor process,
so the kill takes the whole replica down as a preempted node or an OOM kill would.

``UNIRL_TEST_KILL_IN_SYNC=<version>:<marker>``: in the sync to ``<version>``, after the first bucket was
loaded into the model (the weights half-replaced, no receipt yet), the worker writes its pid to
``<marker>`` and SIGKILLs itself, once: a marker that exists disarms it, so the replica a restart
builds syncs that version normally. It is importable in the replica's process by ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from unirl_vllm.extension import UniRLWorkerExtension

KILL_ENV = "UNIRL_TEST_KILL_IN_SYNC"
QUALNAME = "sync_fault.KillInSync"


class KillInSync(UniRLWorkerExtension):
    """:class:`UniRLWorkerExtension` that dies inside one sync session (see the module doc)."""

    def unirl_sync_load(self, weights: list[tuple[str, Any]] | None = None, path: str | None = None) -> int:
        loaded = super().unirl_sync_load(weights=weights, path=path)
        version, _, marker = os.environ.get(KILL_ENV, "").partition(":")
        if version and int(version) == self._unirl_session["version"] and not Path(marker).exists():
            Path(marker).write_text(f"{os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return loaded
