"""The ``sglang`` weight sync: actor weights into every SGLang server, as one receipted version.

Both modes stage first, exactly like core's in-process sync: the actor's ``named_weights()`` stream is
cast to the engine's dtype, renamed by the model adapter, checked against the engine's checkpoint
(names, shapes, dtype, NaN/Inf, completeness, the tied head) and fingerprinted on the way. Only a
complete, valid set reaches the servers.

* ``mode: disk`` (default, always available): :meth:`SGLangEngine.load_weights` writes a versioned
  safetensors directory and every server loads it with ``/update_weights_from_disk``.
* ``mode: distributed`` (NCCL; GPU only, code complete but **not run** in this project's CI): on first
  use every server joins a weight-update group (``POST /init_weights_update_group {master_address,
  master_port, rank_offset, world_size, group_name, backend}``) with this process as rank 0; each sync
  then broadcasts the staged tensors bucket by bucket (:meth:`SGLangEngine.load_distributed`).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from unirl.api import Actor, ConfigError, Receipt, RolloutEngine, WeightSync, WeightSyncError, fingerprint
from unirl_sglang.options import SGLangSyncOptions

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.api import RunConfig
    from unirl_sglang.engine import SGLangEngine


class SGLangWeightSync(WeightSync):
    """``weight_sync.name: sglang`` (options: :class:`~unirl_sglang.options.SGLangSyncOptions`)."""

    Config = SGLangSyncOptions

    def __init__(self, *, config: RunConfig, options: SGLangSyncOptions | None = None) -> None:
        """``options``: ``weight_sync.options`` as the kernel validated it (None: the defaults)."""
        self.config = config
        self.options = options if options is not None else SGLangSyncOptions()
        self._group: Any = None

    def publish(self, actor: Actor, engine: RolloutEngine, version: int) -> tuple[list[Receipt], str]:
        import torch

        from unirl_sglang.engine import SGLangEngine

        if not isinstance(engine, SGLangEngine):
            raise ConfigError(f"weight_sync 'sglang' loads into the 'sglang' engine, not {type(engine).__name__} "
                              "(set rollout.engine: sglang)")
        staged = engine.stage()
        dtype = getattr(torch, staged.spec.dtype.removeprefix("torch."))

        def cast(named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named:
                yield name, tensor.detach().to(dtype)

        staged.fingerprint = fingerprint(staged.tap(cast(iter(actor.named_weights()))))
        if self.options.mode == "disk":
            receipts = engine.load_weights(staged, version)
        else:
            broadcast = self._join(engine)
            receipts = engine.load_distributed(staged, version, broadcast, self.options.group_name,
                                               self.options.bucket_mb << 20)
        return list(receipts), staged.fingerprint

    def _join(self, engine: SGLangEngine) -> Any:
        """Create the weight-update group once: this process is rank 0, server i's ranks follow it."""
        if self._group is not None:
            return self._group
        import torch.distributed as dist

        o = self.options
        world = 1 + o.server_world_size * len(engine.servers)
        bodies = [{"master_address": o.master_address, "master_port": o.master_port,
                   "rank_offset": 1 + i * o.server_world_size, "world_size": world,
                   "group_name": o.group_name, "backend": o.backend} for i in range(len(engine.servers))]
        with ThreadPoolExecutor(max_workers=len(engine.servers)) as pool:
            # the servers block in their rendezvous until rank 0 joins below
            futs = [pool.submit(s.call, "POST", "/init_weights_update_group", b)
                    for s, b in zip(engine.servers, bodies, strict=True)]
            # SGLang's side (init_custom_process_group) joins the TCP store at tcp://address:port and builds
            # its group through torch's _new_process_group_helper, which prefixes the store with the
            # group name: rank 0 mirrors that here.
            store = dist.PrefixStore(f"{o.group_name}/",
                                     dist.TCPStore(o.master_address, o.master_port, world, is_master=True))
            if o.backend == "nccl":
                group = dist.ProcessGroupNCCL(store, 0, world)
            else:
                group = dist.ProcessGroupGloo(store, 0, world)
            for s, f in zip(engine.servers, futs, strict=True):
                res = f.result()
                if isinstance(res, dict) and res.get("success") is False:
                    raise WeightSyncError(f"{s.url}: /init_weights_update_group failed: {res.get('message')}")
        device = "cuda" if o.backend == "nccl" else "cpu"

        def broadcast(t: torch.Tensor) -> None:
            group.broadcast([t.to(device)], dist.BroadcastOptions()).wait()

        self._group = broadcast
        return broadcast


__all__ = ["SGLangWeightSync"]
