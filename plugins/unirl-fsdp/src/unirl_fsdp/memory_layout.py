"""The FSDP actor's declared memory (``Actor.memory_layout``, the memory plan): per rank, its shard of
the fp32 state and the working set of one micro-batch (the shared arithmetic, ``unirl.api.actor_items``).

Why these numbers: FSDP2 shards parameters, gradients and AdamW state over ``world_size`` ranks; with
``reshard_after_forward`` it holds one decoder layer unsharded at a time (plus the one being prefetched)
and the root unit (embedding, head) while it runs; without, every layer stays gathered until backward.
``cpu_offload`` (on CUDA) moves the sharded state to host RAM; the working set stays on the GPU. On the
CPU the ranks' heap keeps backward's whole-layer blocks until the step ends
(``unirl.memory_plan.arithmetic.heap_backward_bytes``); rank 0 also stages the weight stream.
Fixes it declares: more ranks, and on CUDA ``cpu_offload``.
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Any

from unirl.api import DeviceLoad, MemoryFix, MemoryItem, MemoryLayout, ModelFacts, RankShape, actor_items


def _on_cuda(options: Any) -> bool:
    """Where ``device: auto`` will put the ranks. A host without a GPU driver (no ``/dev/nvidia*``, no ROCm
    ``/dev/kfd``) answers without importing torch (the plan stays light); elsewhere torch decides, as the
    ranks will."""
    if options.device in ("cuda", "cpu"):
        return options.device == "cuda"
    if "torch" not in sys.modules and not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd")):
        return False
    import torch

    return torch.cuda.is_available()


def _stream_staging(options: Any, facts: ModelFacts) -> MemoryItem:
    """Rank 0's side of the weight stream (``FSDPWorker.weight_buckets``): it alone keeps the gathered fp32
    tensors, ``bucket_mb`` at a time, and each bucket leaves through Ray's object store, whose shared pages
    rank 0 wrote stay mapped in its process (counted in its RSS) after the stream: two buckets (one
    being filled, one in the store), never more than the model. Measured: rank 0 sat 130-135 MiB above
    the other ranks from the first weight sync on (25 M Qwen3, 2 and 4 ranks, ``bucket_mb`` 64); its
    ``RssShmem`` (the store's pages) reached 236 MiB in a 100 M one-rank run: 2 buckets is the low side."""
    held = min(2 * int(options.bucket_mb * 2**20), 4 * facts.params)
    return MemoryItem("weight stream staging (rank 0)", held, f"2 x bucket_mb {options.bucket_mb:g}, fp32, "
                      "at most the model")


def fsdp_layout(cls: type, config: Any, options: Any, facts: ModelFacts) -> MemoryLayout:
    declared = cls.capabilities(config, options)  # one source: ranks and compute dtype as the actor declares
    w = declared.ranks
    dtype = declared.compute_dtype or config.model.dtype
    blocks = 2 if options.reshard_after_forward else facts.layers
    cuda = _on_cuda(options)
    state, work = actor_items(config, facts, RankShape(ranks=w, compute_dtype=dtype, gathered_blocks=blocks,
                                                       gathers_root=True, heap_backward=not cuda))
    stream = _stream_staging(options, facts)
    loads = []
    for k in range(w):
        host = (stream,) if k == 0 else ()
        if not cuda:
            loads.append(DeviceLoad(f"rank {k}", "host", tuple(state + work) + host))
        elif options.cpu_offload:
            loads += [DeviceLoad(f"gpu:{k}", "gpu", tuple(work)), DeviceLoad(f"rank {k} (offload)", "host", tuple(state) + host)]
        else:
            loads.append(DeviceLoad(f"gpu:{k}", "gpu", tuple(state + work)))
            if host:
                loads.append(DeviceLoad(f"rank {k} (host)", "host", host))
    fixes = [MemoryFix("actor.options.world_size", w * m, f"shard over {w * m} ranks") for m in (2, 4, 8)]
    if cuda and not options.cpu_offload:
        fixes.insert(0, MemoryFix("actor.options.cpu_offload", True, "sharded state in host RAM"))
    if not options.reshard_after_forward:
        fixes.append(MemoryFix("actor.options.reshard_after_forward", True, "one layer gathered at a time"))
    return MemoryLayout(tuple(loads), tuple(fixes))
