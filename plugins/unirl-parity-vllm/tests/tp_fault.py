"""A vLLM worker extension for the TP2 parity tests only: UniRL's own, plus one TP rank whose weights
are perturbed (``test_e2e_vllm_tp2.py``).

Selected through ``rollout.options.engine_args.worker_extension_cls`` (applied last), so production code
holds no test logic; importable in vLLM's spawned TP worker processes through ``PYTHONPATH``.

``UNIRL_TEST_PERTURB_TP=<rank>:<mode>:<marker>``, on TP rank ``<rank>`` only, at every sync:

* ``held``: after the load, one row-parallel weight *shard* this rank holds (layer 0's ``o_proj``, the
  slice of the contraction the other rank gathers) gets ``+1e-3`` on one element. The full tensors it
  received are intact, so its receipt agrees with the sender and the version commits: only the parity
  gate, comparing log-probs, can see it. The receipt's ``shard_fingerprint`` is of the perturbed shard.
* ``received``: before the load, one received full tensor is perturbed, as a corrupted transfer to that
  rank would be; its receipt then disagrees and the engine refuses the version, naming the worker.

The rank writes ``<marker>`` (its pid and what it changed) the first time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from unirl_vllm.extension import UniRLWorkerExtension

PERTURB_ENV = "UNIRL_TEST_PERTURB_TP"
QUALNAME = "tp_fault.PerturbOneRank"


def _armed(rank: int) -> tuple[str, Path] | None:
    target, _, rest = os.environ.get(PERTURB_ENV, "").partition(":")
    mode, _, marker = rest.partition(":")
    return (mode, Path(marker)) if target and int(target) == rank else None


class PerturbOneRank(UniRLWorkerExtension):
    """:class:`UniRLWorkerExtension` with one TP rank's weights perturbed (see the module doc)."""

    def _mark(self, marker: Path, what: str) -> None:
        if not marker.exists():
            marker.write_text(json.dumps({"pid": os.getpid(), "tp_rank": self._unirl_tp_rank(), "changed": what}))

    def unirl_sync_load(self, weights: list[tuple[str, Any]] | None = None, path: str | None = None) -> int:
        armed = _armed(self._unirl_tp_rank())
        if armed is None or armed[0] != "received":
            return super().unirl_sync_load(weights=weights, path=path)
        if path is not None:
            from safetensors import safe_open

            with safe_open(path, framework="pt") as handle:
                order = (handle.metadata() or {}).get("order", "")
                names = order.split("\n") if order else list(handle.keys())
                weights = [(n, handle.get_tensor(n)) for n in names]
        weights = [(n, t.clone()) for n, t in weights or []]
        name, tensor = next((n, t) for n, t in weights if n.endswith("o_proj.weight"))
        tensor.view(-1)[0] += 1e-3
        self._mark(armed[1], f"received {name}")
        return super().unirl_sync_load(weights=weights)

    def unirl_sync_finish(self) -> dict[str, Any]:
        receipt = super().unirl_sync_finish()
        armed = _armed(self._unirl_tp_rank())
        if armed is not None and armed[0] == "held":
            import torch

            name, param = next((n, p) for n, p in self._unirl_model().named_parameters() if n.endswith("o_proj.weight"))
            with torch.no_grad():
                param.view(-1)[0] += 1e-3
            self._mark(armed[1], f"held {name} {tuple(param.shape)}")
            receipt["shard_fingerprint"] = self.unirl_shard_fingerprint()
        return receipt
