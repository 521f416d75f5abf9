"""One rank of the FSDP actor: a Ray actor that owns a shard of the model and the optimizer.

The rank is the embedded actor's skeleton (:class:`unirl.actor.skeleton.ActorSkeleton`: the math,
the replay loop, the micro-batch train loop with its before-backward gate, clip-and-step, SFT); this
module adds only what distribution needs:

* the process group, and ``fully_shard`` per transformer block (+ root, + the value head);
* every rank runs the **same number** of forwards and backwards (FSDP all-gathers parameters in each
  forward and reduce-scatters gradients in each backward: a rank that skipped one would deadlock the
  others). Ranks with fewer micro-batches, or none, run a padding micro-batch whose single token is
  masked out: its loss and gradient are exactly zero, but it takes part in every collective. The
  before-backward hook sees a padding micro-batch as ``samples=[]`` with empty tensors;
* a before-backward failure on one rank is all-reduced, so every rank raises together;
* the loss is divided by the step's *global* denominators (computed by the driver over all ranks) and
  the gradients are **summed** over ranks, not averaged (``set_gradient_divide_factor(1.0)``), so the
  update does not depend on how the batch was sharded;
* checkpoints are sharded (``torch.distributed.checkpoint``) and written with the one atomic
  directory swap of :mod:`unirl.actor.checkpoint`;
* weights leave the group as a stream of buckets gathered by every rank and sent by rank 0 only;
* with ``actor.lora`` every rank applies the same peft adapter (seeded by ``run.seed``) before
  ``fully_shard``: FSDP2 shards the frozen base and the trainable adapter in the same units and
  reduce-scatters gradients of the trainable parameters only, the optimizer holds only the adapter,
  the weight stream is the merged weights (gathered base + gathered adapter, merged as peft merges) and
  checkpoints hold only the adapter (+ value head) and its optimizer state.

Test probes (fault injection, full gradients, memory) live in the plugin's ``tests/fsdp_support.py``, a
subclass selected with ``actor.options.worker_cls``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from unirl.api import (
    CHECKPOINT_EXTRA_FILE,
    CHECKPOINT_META_FILE,
    ActorSkeleton,
    CheckpointError,
    MicroBatch,
    Sample,
    StepInfo,
    UniRLError,
    apply_allocator,
    apply_lora,
    atomic_replace_dir,
    base_fingerprint,
    checkpoint_phase,
    clean_stale,
    freeze_parts,
    fsync_file,
    hf_named_weights,
    install_actor_hooks,
    merged_named_weights,
    resolve_checkpoint,
    rng_state,
    set_rng_state,
    staging_tmp,
    trim_after_transient,
    write_adapter_dir,
    write_meta,
    write_pointer,
)
from unirl_fsdp.export import export_buckets
from unirl_fsdp.loading import empty_like_policy, load_policy
from unirl_fsdp.options import FSDPOptions

#: meta.json ``format`` of an FSDP (sharded, DCP) checkpoint; the embedded actor's is the integer 1.
FORMAT = "fsdp-dcp-1"
DCP_DIR = "dcp"
RNG_DIR = "rng"


class SharedStorageError(UniRLError, RuntimeError):
    """A rank cannot see the checkpoint directory rank 0 made: the run directory is node-local."""


class GateFailedElsewhere(UniRLError, RuntimeError):
    """This rank's before-backward gate passed, another rank's raised: the step stops on every rank."""


def _pad_sample(pad_id: int) -> Sample:
    """A one-token sample with its token masked out: runs the forward/backward, contributes zero."""
    return Sample(id="__fsdp_pad__", prompt_ids=[pad_id], response_ids=[pad_id], loss_mask=[0],
                  rollout_logprobs=[0.0], versions=[0], status="ok")


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _hf_named(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    return hf_named_weights(model, local=_local)


def _adapter_only(state: Mapping[str, Any]) -> dict[str, Any]:
    """A model state dict cut to what a LoRA checkpoint holds: the adapter tensors (and the value head,
    which trains whole); the frozen base is rebuilt from the recipe."""
    return {k: v for k, v in state.items() if ".lora_" in k or k.startswith("value_head.")}


def load_blob(blob: bytes | None, sys_path: Sequence[str] = ()) -> Any:
    """Unpickle what the driver shipped (runtime, callback) after making its modules importable."""
    for root in sys_path:
        if root not in sys.path:
            sys.path.append(root)
    if blob is None:
        return None
    import ray.cloudpickle as cloudpickle

    return cloudpickle.loads(blob)


class FSDPWorker(ActorSkeleton):
    """One rank. Created by :class:`unirl_fsdp.group.RankGroup`; every public method is called on all
    ranks at once (they are collectives), except :meth:`node_info` and :meth:`free_port`.

    ``runtime`` arrives pickled (``ray.cloudpickle``) with the ``sys_path`` roots of the trainer's
    in-process plugins, so the rank runs the trainer's policy loss and plugin set."""

    def __init__(self, *, rank: int, world_size: int, config: Any, adapter: Any, tokenizer: Any,
                 model: Any, options: FSDPOptions, device: str, backend: str, runtime: bytes,
                 sys_path: Sequence[str] = ()) -> None:
        self._init_skeleton(config, load_blob(runtime, sys_path))
        self._sys_path = list(sys_path)
        self.rank, self.world_size = rank, world_size
        self.adapter, self.tokenizer = adapter, tokenizer
        self.options = options
        self.backend = backend
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self._model_arg = model
        self.lora_base: str | None = None  # with actor.lora: the base weights' fingerprint (checkpoints)
        torch.set_num_threads(options.threads_per_rank or max(1, int(options.cpus_per_rank)))
        apply_allocator(config.run.allocator)  # a rank trains as the trainer's process does (unirl.allocator)

    def set_before_backward(self, blob: bytes | None) -> None:
        self.before_backward = load_blob(blob, self._sys_path)

    # ------------------------------------------------------------------ rendezvous + build
    def node_info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "env": {k: v for k, v in os.environ.items() if k.startswith("UNIRL_")}}

    def free_port(self, host: str) -> int:
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the process group, build the model, shard it, build the optimizer."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            self.backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
            world_size=self.world_size, timeout=timedelta(seconds=self.options.step_timeout_s),
        )
        t0 = time.perf_counter()
        if self._model_arg is not None:  # a model handed in whole: shard it
            model, self._model_arg = self._model_arg, None
            self.model = self._shard(model)
        else:  # built on meta, sharded, each rank filling its own shards (unirl_fsdp.loading)
            self.model = load_policy(self)
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)
        # actor.freeze (a VLM's tower): no gradient, no optimizer state, sent once by a weight sync
        frozen = {n: list(self.model.get_parameter(n).shape)
                  for n in freeze_parts(self.model, self.adapter, self.config.actor.freeze)}
        if self.adapter.vision:  # packed text rows apart; every rank runs the tower (its collectives stay paired)
            install_actor_hooks(self._hf(self.model), sharded=True)
        self._setup_training()
        self._adapter_shapes = self._read_adapter_shapes()
        return {"rank": self.rank, "build_s": time.perf_counter() - t0,
                "params": sum(p.numel() for p in self.model.parameters()),
                "local_param_numel": sum(p.to_local().numel() for p in self.model.parameters()),
                "lora_base": self.lora_base, "adapter_shapes": self._adapter_shapes, "frozen": frozen}

    def _hf(self, model: torch.nn.Module) -> torch.nn.Module:
        """The transformers model under a peft wrapper (``actor.lora``), or ``model`` itself."""
        return model.get_base_model() if self.config.actor.lora is not None else model

    def _read_adapter_shapes(self) -> dict[str, list[int]]:
        """The global shape of every tensor a LoRA checkpoint holds, by its checkpoint name (empty without
        ``actor.lora``): the driver checks a checkpoint's against it before any rank loads."""
        if self.lora_base is None:
            return {}
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {k: list(v.shape) for k, v in _adapter_only(get_model_state_dict(self._trainable())).items()
                if ".lora_" in k}

    def _mp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        compute = self.options.compute_dtype or self.config.model.dtype
        param_dtype = None if compute == "float32" else getattr(torch, compute)
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)

    def _offload_policy(self):
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        return CPUOffloadPolicy() if (self.options.cpu_offload and self.device.type == "cuda") else OffloadPolicy()

    def _shard(self, model: torch.nn.Module, *, trainable: bool = True) -> torch.nn.Module:
        """A whole model handed in: fp32 master weights (+ the seeded LoRA adapter), then :meth:`_wrap`:
        ``fully_shard`` each transformer block, then the root (which keeps the embeddings, final norm and
        a tied lm_head together in one unit, as tied weights require)."""
        offloaded = self.options.cpu_offload and self.device.type == "cuda"
        model = self._prepare_model(model, device=None if offloaded else self.device, trainable=trainable)
        if self.config.actor.lora is not None:  # the same adapter on every rank, before sharding
            model = apply_lora(model, self.config.actor.lora, base_path=self.config.model.path,
                               seed=self.config.run.seed)
            if trainable:
                self.lora_base = base_fingerprint(model)  # whole tensors here: every rank gets the same
        return self._wrap(model, trainable=trainable)

    def _wrap(self, model: torch.nn.Module, *, trainable: bool = True) -> torch.nn.Module:
        """``fully_shard`` each transformer block, then the root; a frozen model in eval mode."""
        from torch.distributed.fsdp import fully_shard

        kw = {"mp_policy": self._mp_policy(), "offload_policy": self._offload_policy()}
        block_types = set(getattr(model, "_no_split_modules", None) or ())
        blocks = [m for m in model.modules() if type(m).__name__ in block_types]
        if not blocks:
            raise UniRLError(
                f"actor.name: fsdp shards per transformer block, but {type(model).__name__} names no block "
                "class in _no_split_modules: use actor.name: torch for this model, or a model adapter whose "
                "model declares _no_split_modules")
        for block in blocks:
            fully_shard(block, reshard_after_forward=self.options.reshard_after_forward, **kw)
        fully_shard(model, reshard_after_forward=self.options.reshard_after_forward, **kw)
        self._sum_gradients(model)
        if not trainable:
            model.eval()
            model.requires_grad_(False)
        return model

    def _place_head(self, head: torch.nn.Module) -> torch.nn.Module:
        """The value head as its own FSDP unit (fp32 reduction, the model's offload policy)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        head = head.to(self.device)
        fully_shard(head, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32),
                    offload_policy=self._offload_policy())
        self._sum_gradients(head)
        return head

    @staticmethod
    def _sum_gradients(module: torch.nn.Module) -> None:
        """Reduce-scatter with SUM and no division: the losses already carry the global denominators.

        ``force_sum_reduction`` keeps the collective a plain SUM (gloo has no PREMUL_SUM / AVG)."""
        for m in module.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)

    def _reshard(self) -> None:
        """Back to sharded parameters everywhere. A forward without backward leaves them gathered when
        ``reshard_after_forward`` is False; shard-wise code (copies, state dicts, gathers) needs them
        sharded, and gathered copies only waste memory outside a step."""
        from torch.distributed.fsdp import FSDPModule

        for root in (self.model, self.value_head, self.reference):
            if root is None:
                continue
            for m in root.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def snapshot_reference(self) -> None:
        """Freeze the current weights as the KL reference: a second sharded model, shard-for-shard copy."""
        if self.config.algorithm.kl_coef <= 0:
            self.reference = None
            return
        if self.reference is None:  # shards allocated, not filled: they are copied below
            self.reference = empty_like_policy(self) or self._shard(
                self.adapter.build_model(self.config, self.tokenizer), trainable=False)
            if self.adapter.vision:
                install_actor_hooks(self._hf(self.reference), sharded=True)
        self._reshard()
        with torch.no_grad():
            src = dict(self.model.named_parameters())
            for name, p in self.reference.named_parameters():
                p.to_local().copy_(src[name].to_local())
            buffers = dict(self.model.named_buffers())
            for name, b in self.reference.named_buffers():
                b.copy_(buffers[name])

    # ------------------------------------------------------------------ distribution seams
    _local = staticmethod(_local)  # each rank keeps and swaps its own shards (unirl.actor.held_versions)

    @staticmethod
    def _full(t: Tensor) -> Tensor:
        """The whole tensor behind a (possibly sharded) parameter: a collective for DTensors."""
        return t.full_tensor() if _is_dtensor(t) else t

    def _after_replay(self) -> None:
        self._reshard()

    def _agree(self, error: BaseException | None) -> None:
        """Collective-safe gate: if one rank's before-backward raised, every rank raises together."""
        flag = torch.tensor([1.0 if error is not None else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            if error is not None:
                raise error
            raise GateFailedElsewhere(f"rank {self.rank}: before_backward raised on another rank (this rank's "
                                      "gate passed); see that rank's error")

    def _micro_batches(self, samples: Sequence[Sample], batch: Mapping[str, Sequence[Tensor] | None] | None = None,
                       *, size: int | None = None, count: int | None = None) -> list[MicroBatch]:
        """The skeleton's micro-batches, then padding ones up to ``count`` (the driver's plan for the
        busiest rank). A micro-batch with no response token at all gets the pad sample appended too:
        the shared forward skips the model when there is nothing to predict, and every rank must run it."""
        micros = super()._micro_batches(samples, batch, size=size)
        count = len(micros) if count is None else count
        if len(micros) > count:
            raise RuntimeError(f"rank {self.rank}: {len(micros)} micro-batches, driver planned {count}")
        keys = [k for k, v in (batch or {}).items() if v is not None]
        micros += [MicroBatch([], {k: [] for k in keys}, 0) for _ in range(count - len(micros))]
        for mb in micros:
            if sum(len(s.response_ids) for s in mb.samples) == 0:
                mb.samples = mb.samples + [_pad_sample(self.pad_id)]
                mb.batch = {k: list(mb.batch[k] or []) + [torch.zeros(1)] for k in keys}
        return micros

    # ------------------------------------------------------------------ replay
    def logprobs(self, samples: list[Sample], num_micro: int) -> list[Tensor]:
        return self._replay(self.model, samples, phase="replay", count=num_micro)

    def logprobs_at(self, samples: list[Sample], num_micro: int, version: int) -> list[Tensor]:
        return self._replay_at(version, samples, count=num_micro)

    def values(self, samples: list[Sample], num_micro: int) -> list[Tensor]:
        return self._replay(self.model, samples, phase="replay", values=True, count=num_micro)

    def ref_logprobs(self, samples: list[Sample], num_micro: int) -> list[Tensor]:
        return self._replay(self.reference, samples, phase="reference", count=num_micro)

    # ------------------------------------------------------------------ updates
    def train_step(self, samples: list[Sample], batch: dict[str, list[Tensor] | None], total_tokens: float,
                   total_seqs: float, num_micro: int, info: StepInfo = StepInfo()) -> dict[str, Any]:
        micros = self._micro_batches(samples, batch, count=num_micro)
        out = self._train_update(micros, info, total_tokens=total_tokens, total_seqs=total_seqs)
        trim_after_transient(self.config.run.allocator)  # the step's activations and gathers (unirl.allocator)
        return out

    def sft_step(self, samples: list[Sample], total_tokens: float, num_micro: int) -> dict[str, Any]:
        return self._sft_update(self._micro_batches(samples, count=num_micro), total_tokens=total_tokens)

    # ------------------------------------------------------------------ weights out
    def weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
        """Stream the full weights in buckets, in the embedded actor's names and order. Every rank
        gathers every tensor (all-gather is a collective); only rank 0 keeps and yields them, so at most
        one bucket of full tensors exists at a time on top of the shards."""
        self._reshard()
        bucket: list[tuple[str, Tensor]] = []
        size = 0
        with torch.no_grad():
            for name, full in self._full_weights():
                if self.rank != 0:
                    del full
                    continue
                bucket.append((name, full))
                size += full.numel() * full.element_size()
                if size >= bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
        if bucket:
            yield bucket
        trim_after_transient(self.config.run.allocator)  # the gathered tensors' pages (unirl.allocator)

    def _full_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Every HF-named weight, whole, on the CPU and not aliasing a live weight; with ``actor.lora``
        the merged ones (:func:`unirl.actor.lora.merged_named_weights` on the gathered tensors). Every rank
        must run it to the end (each tensor is an all-gather)."""
        if self.lora_base is not None:
            for name, t in merged_named_weights(self.model, _hf_named, full=self._full):
                yield name, t.to("cpu", copy=True)
            return
        for name, t in _hf_named(self.model):
            full = self._full(t)
            # a gathered DTensor is a fresh tensor; a plain one is the live weight: copy it
            yield name, (full.cpu() if _is_dtensor(t) else full.to("cpu", copy=True))

    def export_hf(self, path: str) -> None:
        """The weights as multi-file safetensors with an index (:mod:`unirl_fsdp.export`): every rank
        gathers one tensor at a time, rank 0 writes a bucket (``bucket_mb``) at a time; with ``actor.lora`` the merged
        weights, in the base model's class and names."""
        self._reshard()
        base = self.model.get_base_model() if self.lora_base is not None else self.model
        export_buckets(path, self._full_weights(), write=self.rank == 0, hf_config=base.config,
                       tokenizer=self.tokenizer, shard_bytes=int(self.options.bucket_mb * 2**20))
        dist.barrier()

    def export_adapter(self, path: str) -> None:
        """The adapter alone as a peft directory (``PeftModel.from_pretrained(base, path)`` loads it): the
        adapter tensors gathered whole (every rank takes part), written by rank 0."""
        self._reshard()
        with torch.no_grad():
            state = {n: self._full(t).cpu() for n, t in self.model.state_dict().items() if ".lora_" in n}
        if self.rank == 0:
            write_adapter_dir(path, self.model, self.tokenizer, state_dict=state)
        del state
        dist.barrier()

    # ------------------------------------------------------------------ checkpoints
    def _trainable(self) -> torch.nn.Module:
        """Policy and value head under one root, so one optimizer state dict maps every parameter to a
        name (the value head is its own FSDP root, outside the policy)."""
        parts = {"policy": self.model}
        if self.value_head is not None:
            parts["value_head"] = self.value_head
        return torch.nn.ModuleDict(parts)

    def _dcp_state(self, held: Sequence[str] | None = None) -> dict[str, Any]:
        """What goes into the sharded checkpoint. An optimizer's state is included only once it exists
        (``get_optimizer_state_dict`` would otherwise initialise it with a zero-LR step, advancing
        AdamW's step counter and changing the next update)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        root = self._trainable()
        keep = _adapter_only if self.lora_base is not None else dict
        state: dict[str, Any] = {"model": keep(get_model_state_dict(root))}

        def want(key: str, exists: bool) -> bool:
            return key in held if held is not None else exists

        if want("optim", bool(self.optimizer.state)):
            state["optim"] = get_optimizer_state_dict(root, self.optimizer)
        if self.reference is not None and want("reference", True):
            state["reference"] = keep(get_model_state_dict(self.reference))
        if want("sft_optim", self._sft_optimizer is not None and bool(self._sft_optimizer.state)):
            state["sft_optim"] = get_optimizer_state_dict(self.model, self.sft_optimizer)
        return state

    def _write_shards(self, tmp: Path) -> list[str]:
        """This rank's part of a checkpoint: its DCP shards and its RNG state. Returns the state keys."""
        import torch.distributed.checkpoint as dcp

        self._reshard()
        state = self._dcp_state()
        dcp.save(state, checkpoint_id=str(tmp / DCP_DIR))
        rng_file = tmp / RNG_DIR / f"rank{self.rank}.pt"
        torch.save(rng_state(), rng_file)
        fsync_file(rng_file)
        return sorted(state)

    def save(self, path: str, extra: Mapping[str, Any] | None) -> str:
        """Atomic sharded checkpoint: every rank writes its shards into ``<path>.tmp-<pid>``; rank 0
        then writes ``extra.pt`` and ``meta.json`` (last) and swaps the directory into place
        (:func:`unirl.actor.checkpoint.atomic_replace_dir`), so a crash at any point leaves the previous
        checkpoint whole and ``latest`` naming it."""
        dest = Path(path).absolute()
        name: list[str | None] = [None]
        if self.rank == 0:
            dest.parent.mkdir(parents=True, exist_ok=True)
            clean_stale(dest)
            tmp = staging_tmp(dest)
            (tmp / RNG_DIR).mkdir(parents=True)
            name = [str(tmp)]
        dist.broadcast_object_list(name, src=0)
        tmp = Path(name[0])
        self._check_shared(tmp)
        states = self._write_shards(tmp)
        checkpoint_phase(f"save:{dest.name}:rank{self.rank}")  # a drill's phase callback acts here
        dist.barrier()
        if self.rank == 0:
            extra_obj = {"actor": {"step": self.step, "scheduler": self.scheduler.state_dict(),
                                   "world_size": self.world_size, "lora_base": self.lora_base},
                         "trainer": dict(extra or {})}
            torch.save(extra_obj, tmp / CHECKPOINT_EXTRA_FILE)
            fsync_file(tmp / CHECKPOINT_EXTRA_FILE)
            write_meta(tmp, {"format": FORMAT, "world_size": self.world_size, "states": states,
                             "value_head": self.value_head is not None, "adapter": self._adapter_shapes or None,
                             "files": [DCP_DIR, RNG_DIR, CHECKPOINT_EXTRA_FILE]})
            atomic_replace_dir(tmp, dest)
            checkpoint_phase(f"commit:{dest.name}")
            write_pointer(dest.parent, dest.name)
        dist.barrier()
        return str(dest)

    def _check_shared(self, tmp: Path) -> None:
        """Every rank writes its shards into the directory rank 0 made: on a multi-node cluster that
        only works when the run directory is on storage all nodes share. Checked collectively (every
        rank raises together) before the first shard is written."""
        missing = not tmp.is_dir()
        flag = torch.tensor([1.0 if missing else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            import ray

            where = "this rank's node" if missing else "another rank's node"
            raise SharedStorageError(
                f"rank {self.rank} (node {ray.get_runtime_context().get_node_id()[:8]}): the checkpoint directory "
                f"{tmp} that rank 0 created is not visible on {where}. The run directory (run.output_dir) must "
                "be on storage shared by every node that hosts a rank (NFS, Lustre, a PVC; see docs/cluster.md)")

    def load(self, path: str) -> dict[str, Any]:
        """Restore a checkpoint written by :meth:`save` with any world size (DCP reshards)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        src = resolve_checkpoint(path)
        meta = json.loads((src / CHECKPOINT_META_FILE).read_text())
        if meta.get("format") != FORMAT:
            raise CheckpointError(
                f"checkpoint {src}: format {meta.get('format')!r} is not an fsdp checkpoint ({FORMAT!r}); "
                "the embedded actor's checkpoints load with actor.name: torch")
        held = list(meta["states"])
        if bool(meta.get("value_head")) != (self.value_head is not None):
            raise CheckpointError(
                f"checkpoint {src}: value_head={bool(meta.get('value_head'))}, this actor has "
                f"value_head={self.value_head is not None}: set actor.value_head to what it was trained with")
        if "reference" in held and self.reference is None:
            held.remove("reference")  # kl_coef is 0 now: the reference is not needed
        self._reshard()
        state = self._dcp_state(held)
        dcp.load(state, checkpoint_id=str(src / DCP_DIR))
        root = self._trainable()
        # a LoRA checkpoint holds the adapter only: the frozen base it leaves out stays as built
        opts = StateDictOptions(strict=self.lora_base is None)
        set_model_state_dict(root, state["model"], options=opts)
        if "optim" in state:
            set_optimizer_state_dict(root, self.optimizer, state["optim"])
        if "reference" in state:
            set_model_state_dict(self.reference, state["reference"], options=opts)
        if "sft_optim" in state:
            set_optimizer_state_dict(self.model, self.sft_optimizer, state["sft_optim"])
        extra = torch.load(src / CHECKPOINT_EXTRA_FILE, map_location="cpu", weights_only=False)
        self.scheduler.load_state_dict(extra["actor"]["scheduler"])
        self.step = int(extra["actor"]["step"])
        rng_file = src / RNG_DIR / f"rank{self.rank}.pt"
        if rng_file.is_file():  # a rank that did not exist when saved keeps its own RNG
            set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
        dist.barrier()
        return dict(extra.get("trainer", {}))

    def get_step(self) -> int:
        return self.step

    def memory_peaks(self) -> Any:
        """This rank's peak memory since it last answered (:mod:`unirl_fsdp.memory`)."""
        from unirl_fsdp.memory import rank_peak

        return rank_peak()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
