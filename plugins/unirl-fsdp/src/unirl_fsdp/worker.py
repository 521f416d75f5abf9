"""One rank of the FSDP actor: a Ray actor that owns a shard of the model and the optimizer.

The per-micro-batch math is the embedded actor's (:mod:`unirl.actor.torch_actor`), imported, not
copied; this module only adds what distribution needs:

* every rank runs the **same number** of forwards and backwards (FSDP all-gathers parameters in each
  forward and reduce-scatters gradients in each backward: a rank that skipped one would deadlock the
  others). Ranks with fewer micro-batches, or none, run a padding micro-batch whose single token is
  masked out: its loss and gradient are exactly zero, but it takes part in every collective;
* the loss is divided by the step's *global* denominators (computed by the driver over all ranks) and
  the gradients are **summed** over ranks, not averaged (``set_gradient_divide_factor(1.0)``), so the
  update does not depend on how the batch was sharded;
* checkpoints are sharded (``torch.distributed.checkpoint``) and written with the same atomic
  temp-dir protocol as the embedded actor's checkpoints (:mod:`unirl.actor.checkpoint`);
* weights leave the group as a stream of buckets gathered by every rank and sent by rank 0 only.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from unirl.actor import checkpoint as ckpt
from unirl.actor.torch_actor import (
    build_optimizer,
    build_scheduler,
    forward_logprobs,
    micro_batch_loss,
    sft_micro_batch_loss,
    train_params,
)
from unirl.packing import pack
from unirl.samples import Sample, chunks
from unirl_fsdp.options import FSDPOptions

#: meta.json ``format`` of an FSDP (sharded, DCP) checkpoint; the embedded actor's is the integer 1.
FORMAT = "fsdp-dcp-1"
DCP_DIR = "dcp"
RNG_DIR = "rng"

#: Fault injection for tests and drills: ``"<rank>:<method>[:<n>]"`` makes that rank exit its process in
#: the middle of the n-th call (default 1st) of ``method``: train_step/sft_step after the first backward,
#: save after writing its shards. Reaches the workers through ``worker_env`` like any plugin's variable.
FAULT_ENV = "UNIRL_FSDP_INJECT_FAULT"


def _pad_sample(pad_id: int) -> Sample:
    """A one-token sample with its token masked out: runs the forward/backward, contributes zero."""
    return Sample(id="__fsdp_pad__", prompt_ids=[pad_id], response_ids=[pad_id], loss_mask=[0],
                  rollout_logprobs=[0.0], versions=[0], status="ok")


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _full(t: Tensor) -> Tensor:
    """The whole tensor behind a (possibly sharded) parameter: a collective for DTensors."""
    return t.full_tensor() if _is_dtensor(t) else t


class FSDPWorker:
    """One rank. Created by :class:`unirl_fsdp.group.RankGroup`; every public method is called on all
    ranks at once (they are collectives), except :meth:`node_info` and :meth:`free_port`."""

    def __init__(self, *, rank: int, world_size: int, config: Any, adapter: Any, tokenizer: Any,
                 model: Any, options: FSDPOptions, device: str, backend: str,
                 before_backward: Any = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.config, self.adapter, self.tokenizer = config, adapter, tokenizer
        self.options = options
        self.backend = backend
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.before_backward = before_backward
        self._model_arg = model
        self.model: torch.nn.Module | None = None
        self.value_head: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        self._sft_optimizer: torch.optim.Optimizer | None = None
        self.step = 0
        threads = options.threads_per_rank or max(1, int(options.cpus_per_rank))
        torch.set_num_threads(threads)
        self._rss_start_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        fault = os.environ.get(FAULT_ENV, "").split(":")
        self._fault = fault[1] if len(fault) >= 2 and fault[0].strip() == str(rank) else ""
        self._fault_at = int(fault[2]) if len(fault) >= 3 else 1
        self._calls: dict[str, int] = {}

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
        model = self._model_arg if self._model_arg is not None else self.adapter.build_model(
            self.config, self.tokenizer)
        self._model_arg = None
        self.pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        self.model = self._shard(model)
        if self.config.actor.value_head:
            # the embedded actor's init (zeros), sharded like the rest
            head = torch.nn.Linear(model.config.hidden_size, 1)
            torch.nn.init.zeros_(head.weight)
            torch.nn.init.zeros_(head.bias)
            self.value_head = self._shard_head(head)
        self.optimizer = build_optimizer(self._train_params(), self.config)
        self.scheduler = build_scheduler(self.optimizer, self.config)
        if self.config.algorithm.kl_coef > 0:
            self.snapshot_reference()
        if self.before_backward is None:
            self.before_backward = self._kernel_gate()
        self._rss_setup_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"rank": self.rank, "build_s": time.perf_counter() - t0,
                "params": sum(p.numel() for p in self.model.parameters()),
                "local_param_numel": sum(p.to_local().numel() for p in self.model.parameters())}

    def _kernel_gate(self) -> Any:
        """The kernel's ``unirl_before_backward`` hook (the parity gate), run here on every rank where
        the log-probs live, when an installed plugin implements it; None otherwise."""
        from unirl.kernel import load_kernel

        kernel = load_kernel()
        if not kernel.hook.unirl_before_backward.get_hookimpls():
            return None

        def gate(samples: list[Sample], logprobs: Tensor) -> None:
            kernel.hook.unirl_before_backward(step=self.step, samples=samples, logprobs=logprobs,
                                              config=self.config)

        return gate

    def _mp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        compute = self.options.compute_dtype or self.config.model.dtype
        param_dtype = None if compute == "float32" else getattr(torch, compute)
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)

    def _fsdp_kwargs(self) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        offload = CPUOffloadPolicy() if (self.options.cpu_offload and self.device.type == "cuda") else OffloadPolicy()
        return {"mp_policy": self._mp_policy(), "offload_policy": offload}

    def _shard(self, model: torch.nn.Module, *, trainable: bool = True) -> torch.nn.Module:
        """fp32 master weights; ``fully_shard`` each transformer block, then the root (which keeps the
        embeddings, final norm and a tied lm_head together in one unit, as tied weights require)."""
        from torch.distributed.fsdp import fully_shard

        model = model.to(dtype=torch.float32)
        if not self.options.cpu_offload or self.device.type != "cuda":
            model = model.to(self.device)
        model.config.use_cache = False
        if trainable and self.config.actor.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        kw = self._fsdp_kwargs()
        block_types = set(getattr(model, "_no_split_modules", None) or ())
        blocks = [m for m in model.modules() if type(m).__name__ in block_types]
        if not blocks:
            raise ValueError(f"{type(model).__name__} names no transformer block class in _no_split_modules; "
                             "the fsdp actor shards per block")
        for block in blocks:
            fully_shard(block, reshard_after_forward=self.options.reshard_after_forward, **kw)
        fully_shard(model, reshard_after_forward=self.options.reshard_after_forward, **kw)
        self._sum_gradients(model)
        if not trainable:
            model.eval()
            model.requires_grad_(False)
        return model

    def _shard_head(self, head: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        head = head.to(self.device)
        fully_shard(head, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32),
                    offload_policy=self._fsdp_kwargs()["offload_policy"])
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

    def _train_params(self) -> list[torch.nn.Parameter]:
        return train_params(self.model, self.value_head)

    @property
    def sft_optimizer(self) -> torch.optim.Optimizer:
        if self._sft_optimizer is None:
            self._sft_optimizer = build_optimizer(list(self.model.parameters()), self.config, lr=self.config.sft.lr)
        return self._sft_optimizer

    def snapshot_reference(self) -> None:
        """Freeze the current weights as the KL reference: a second sharded model, shard-for-shard copy."""
        if self.config.algorithm.kl_coef <= 0:
            self.reference = None
            return
        if self.reference is None:
            ref = self.adapter.build_model(self.config, self.tokenizer)
            self.reference = self._shard(ref, trainable=False)
        self._reshard()
        with torch.no_grad():
            src = dict(self.model.named_parameters())
            for name, p in self.reference.named_parameters():
                p.to_local().copy_(src[name].to_local())

    # ------------------------------------------------------------------ helpers
    def _maybe_fault(self, where: str) -> None:
        """Die here if ``UNIRL_FSDP_INJECT_FAULT`` says so (called once per call of ``where``)."""
        self._calls[where] = self._calls.get(where, 0) + 1
        if self._fault == where and self._calls[where] == self._fault_at:
            os._exit(13)

    def _micro_batches(self, samples: Sequence[Sample], num_micro: int,
                       size: int | None = None) -> list[tuple[list[Sample], bool]]:
        """``num_micro`` micro-batches of ``micro_batch_size``: the real ones, then padding ones.

        Returns ``(samples, padded)``; a padded micro-batch ends with the pad sample (also appended to a
        real micro-batch that has no response token at all, because the shared forward skips the
        model when there is nothing to predict, and every rank must run it)."""
        out = []
        for micro in chunks(list(samples), size or self.config.actor.micro_batch_size):
            if sum(len(s.response_ids) for s in micro) == 0:
                out.append((micro + [_pad_sample(self.pad_id)], True))
            else:
                out.append((micro, False))
        if len(out) > num_micro:
            raise RuntimeError(f"rank {self.rank}: {len(out)} micro-batches, driver planned {num_micro}")
        out += [([_pad_sample(self.pad_id)], True)] * (num_micro - len(out))
        return out

    @staticmethod
    def _pad_batch(mb: Mapping[str, Sequence[Tensor] | None], keys: Sequence[str], n_real: int,
                   n_pad: int) -> dict[str, list[Tensor] | None]:
        out: dict[str, list[Tensor] | None] = {}
        for k in keys:
            vals = list(mb.get(k) or [])[:n_real]
            out[k] = vals + [torch.zeros(1)] * n_pad
        return out

    def _gate(self, error: BaseException | None) -> None:
        """Collective-safe ``before_backward``: if one rank's gate raised, every rank raises together."""
        flag = torch.tensor([1.0 if error is not None else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            if error is not None:
                raise error
            raise RuntimeError("before_backward failed on another rank (this rank's gate passed)")

    def _clip_and_step(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> float:
        clip = self.config.actor.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=clip if clip > 0 else math.inf)
        norm = _full(norm)
        optimizer.step()
        return float(norm)

    # ------------------------------------------------------------------ replay
    def _replay(self, model: torch.nn.Module, samples: list[Sample], num_micro: int, *,
                values: bool = False) -> list[Tensor]:
        out: list[Tensor] = []
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for micro, padded in self._micro_batches(samples, num_micro):
                    packed = pack(micro).to(self.device)
                    logp, _, vals = forward_logprobs(model, packed,
                                                     value_head=self.value_head if values else None)
                    flat = vals if values else logp
                    per = [t.float().cpu() for t in packed.split(flat.detach())]
                    out.extend(per[:-1] if padded else per)
        finally:
            model.train(was_training)
            self._reshard()
        return out

    def logprobs(self, samples: list[Sample], num_micro: int) -> list[Tensor]:
        return self._replay(self.model, samples, num_micro)

    def values(self, samples: list[Sample], num_micro: int) -> list[Tensor]:
        return self._replay(self.model, samples, num_micro, values=True)

    def ref_logprobs(self, samples: list[Sample], num_micro: int) -> list[Tensor]:
        return self._replay(self.reference, samples, num_micro)

    # ------------------------------------------------------------------ updates
    def train_step(self, samples: list[Sample], batch: dict[str, list[Tensor] | None], keys: list[str],
                   total_tokens: float, total_seqs: float, num_micro: int) -> dict[str, Any]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        parts = []
        start = 0
        for i, (micro, padded) in enumerate(self._micro_batches(samples, num_micro)):
            n_real = len(micro) - (1 if padded else 0)
            mb = {k: (v[start:start + n_real] if v is not None else None) for k, v in batch.items()}
            start += n_real
            if padded:
                mb = self._pad_batch(mb, keys, n_real, 1)
            error: list[BaseException] = []

            def gate(ms: list[Sample], logp: Tensor, _pad: bool = padded, _err: list = error) -> None:
                if self.before_backward is None or (_pad and len(ms) == 1):
                    return
                try:
                    self.before_backward(ms[:-1] if _pad else ms, logp[:-1] if _pad else logp)
                except BaseException as exc:  # noqa: BLE001 - re-raised collectively in _gate
                    _err.append(exc)

            loss, metrics = micro_batch_loss(
                self.model, micro, mb, config=self.config, total_tokens=total_tokens, total_seqs=total_seqs,
                value_head=self.value_head, reference=self.reference,
                before_backward=gate if self.before_backward is not None else None, device=self.device,
            )
            if self.before_backward is not None:
                self._gate(error[0] if error else None)
            loss.backward()
            if not (padded and n_real == 0):
                parts.append({k: float(v) for k, v in metrics.items()})
            if i == 0:
                self._maybe_fault("train_step")
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm = self._clip_and_step(self.optimizer, self._train_params())
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"parts": parts, "grad_norm": grad_norm, "lr": lr}

    def sft_step(self, samples: list[Sample], total_tokens: float, num_micro: int) -> dict[str, Any]:
        opt = self.sft_optimizer
        self.model.train()
        opt.zero_grad(set_to_none=True)
        parts = []
        for i, (micro, padded) in enumerate(self._micro_batches(samples, num_micro)):
            loss, metrics = sft_micro_batch_loss(self.model, micro, total_tokens=total_tokens)
            loss.backward()
            if not (padded and len(micro) == 1):
                parts.append({k: float(v) for k, v in metrics.items()})
            if i == 0:
                self._maybe_fault("sft_step")
        grad_norm = self._clip_and_step(opt, list(self.model.parameters()))
        opt.zero_grad(set_to_none=True)
        return {"parts": parts, "grad_norm": grad_norm, "lr": opt.param_groups[0]["lr"]}

    # ------------------------------------------------------------------ inspection (tests, benchmark)
    def full_grads_after_backward(self, samples: list[Sample], batch: dict[str, list[Tensor] | None],
                                  keys: list[str], total_tokens: float, total_seqs: float,
                                  num_micro: int, config: Any = None) -> dict[str, Any]:
        """Loss and full gradients of one step without the optimizer step (equivalence tests).
        ``config`` overrides the run config for this call only (e.g. another ``loss_agg``)."""
        config = config or self.config
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64)
        start = 0
        for micro, padded in self._micro_batches(samples, num_micro, config.actor.micro_batch_size):
            n_real = len(micro) - (1 if padded else 0)
            mb = {k: (v[start:start + n_real] if v is not None else None) for k, v in batch.items()}
            start += n_real
            if padded:
                mb = self._pad_batch(mb, keys, n_real, 1)
            loss, _ = micro_batch_loss(self.model, micro, mb, config=config, total_tokens=total_tokens,
                                       total_seqs=total_seqs, value_head=self.value_head,
                                       reference=self.reference, device=self.device)
            loss.backward()
            loss_sum += loss.detach().double().cpu()
        grads = {}
        named = list(self.model.named_parameters())
        if self.value_head is not None:
            named += [(f"value_head.{n}", p) for n, p in self.value_head.named_parameters()]
        for name, p in named:
            g = _full(p.grad) if p.grad is not None else None
            if self.rank == 0 and g is not None:
                grads[name] = g.detach().cpu().clone()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": float(loss_sum), "grads": grads if self.rank == 0 else None}

    def memory(self) -> dict[str, float]:
        """Peak RSS of this process and the bytes this rank holds in params, grads and optimizer state."""
        def nbytes(t: Tensor) -> int:
            t = t.to_local() if _is_dtensor(t) else t
            return t.numel() * t.element_size()

        params = sum(nbytes(p) for p in self._train_params())
        optim = 0
        for st in self.optimizer.state.values():
            optim += sum(nbytes(v) for v in st.values() if isinstance(v, Tensor) and v.dim() > 0)
        return {"rank": self.rank, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "start_rss_mb": self._rss_start_kb / 1024, "setup_rss_mb": self._rss_setup_kb / 1024,
                "param_mb": params / 2**20,
                "optim_mb": optim / 2**20}

    # ------------------------------------------------------------------ weights out
    def _state_items(self) -> Iterator[tuple[str, Tensor]]:
        """The model's state dict in HF names, each storage once (tied ``lm_head.weight`` skipped), in
        the same order and with the same names as the embedded actor's ``hf_named_weights``."""
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name, t in self.model.state_dict().items():
            local = t.to_local() if _is_dtensor(t) else t
            key = (local.data_ptr(), tuple(t.shape))
            if local.numel() and key in seen:
                continue
            seen.add(key)
            yield name, t

    def weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
        """Stream the full weights in buckets. Every rank gathers every tensor (all-gather is a
        collective); only rank 0 keeps and yields them, so at most one bucket of full tensors exists
        at a time on top of the shards."""
        self._reshard()
        bucket: list[tuple[str, Tensor]] = []
        size = 0
        with torch.no_grad():
            for name, t in self._state_items():
                full = _full(t.detach())
                if self.rank != 0:
                    del full
                    continue
                # a gathered DTensor is a fresh tensor; a plain one is the live weight: copy it
                full = full.cpu() if _is_dtensor(t) else full.to("cpu", copy=True)
                bucket.append((name, full))
                size += full.numel() * full.element_size()
                if size >= bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
        if bucket:
            yield bucket

    def export_hf(self, path: str) -> None:
        """Gather the full state on rank 0 (every rank takes part) and write ``save_pretrained``'s format."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self._reshard()
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            from transformers import AutoModelForCausalLM

            dest = Path(path).absolute()
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                # a shell of the plain HF class on the meta device: the FSDP-wrapped model would name
                # its own class ("FSDPQwen3ForCausalLM") in config.architectures
                with torch.device("meta"):
                    shell = AutoModelForCausalLM.from_config(self.model.config)
                shell.save_pretrained(str(tmp), state_dict=full)
                if self.tokenizer is not None:
                    self.tokenizer.save_pretrained(str(tmp))
                old = None
                if dest.exists():
                    old = dest.parent / f".{dest.name}.old-{os.getpid()}"
                    os.replace(dest, old)
                os.replace(tmp, dest)
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        del full
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
        state: dict[str, Any] = {"model": get_model_state_dict(root)}

        def want(key: str, exists: bool) -> bool:
            return key in held if held is not None else exists

        if want("optim", bool(self.optimizer.state)):
            state["optim"] = get_optimizer_state_dict(root, self.optimizer)
        if self.reference is not None and want("reference", True):
            state["reference"] = get_model_state_dict(self.reference)
        if want("sft_optim", self._sft_optimizer is not None and bool(self._sft_optimizer.state)):
            state["sft_optim"] = get_optimizer_state_dict(self.model, self.sft_optimizer)
        return state

    def save(self, path: str, extra: Mapping[str, Any] | None) -> str:
        """Atomic sharded checkpoint: every rank writes its shards into ``<path>.tmp-<pid>``; rank 0
        then writes ``extra.pt`` and ``meta.json`` (last) and renames the directory into place, so a
        crash at any point leaves the previous checkpoint whole and ``latest`` naming it."""
        import torch.distributed.checkpoint as dcp

        dest = Path(path).absolute()
        if self.rank == 0:
            dest.parent.mkdir(parents=True, exist_ok=True)
            ckpt.clean_stale(dest)
            tmp = dest.parent / f"{dest.name}.tmp-{os.getpid()}"
            tmp.mkdir()
            (tmp / RNG_DIR).mkdir()
            name = [str(tmp)]
        else:
            name = [None]
        dist.broadcast_object_list(name, src=0)
        tmp = Path(name[0])
        self._reshard()
        state = self._dcp_state()
        dcp.save(state, checkpoint_id=str(tmp / DCP_DIR))
        rng_file = tmp / RNG_DIR / f"rank{self.rank}.pt"
        torch.save(ckpt.rng_state(), rng_file)
        ckpt.fsync_file(rng_file)
        self._maybe_fault("save")
        dist.barrier()
        if self.rank == 0:
            extra_obj = {"actor": {"step": self.step, "scheduler": self.scheduler.state_dict(),
                                   "world_size": self.world_size},
                         "trainer": dict(extra or {})}
            torch.save(extra_obj, tmp / ckpt.EXTRA_FILE)
            ckpt.fsync_file(tmp / ckpt.EXTRA_FILE)
            with open(tmp / ckpt.META_FILE, "w") as f:
                json.dump({"format": FORMAT, "world_size": self.world_size, "states": sorted(state),
                           "value_head": self.value_head is not None,
                           "files": [DCP_DIR, RNG_DIR, ckpt.EXTRA_FILE]}, f)
                f.flush()
                os.fsync(f.fileno())
            ckpt.fsync_dir(tmp)
            old = None
            try:
                if dest.exists():
                    old = dest.parent / f"{dest.name}.old-{os.getpid()}"
                    os.replace(dest, old)
                os.replace(tmp, dest)
                ckpt.fsync_dir(dest.parent)
            except BaseException:
                if old is not None and not dest.exists():
                    os.replace(old, dest)
                raise
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            ckpt.write_pointer(dest.parent, dest.name)
        dist.barrier()
        return str(dest)

    def load(self, path: str) -> dict[str, Any]:
        """Restore a checkpoint written by :meth:`save` with any world size (DCP reshards)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        src = ckpt.resolve_checkpoint(path)
        meta = json.loads((src / ckpt.META_FILE).read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"checkpoint {src}: format {meta.get('format')!r} is not an fsdp checkpoint "
                             f"({FORMAT!r}); the embedded actor's checkpoints load with actor.name: torch")
        held = list(meta["states"])
        if bool(meta.get("value_head")) != (self.value_head is not None):
            raise ValueError(f"checkpoint {src}: value_head={bool(meta.get('value_head'))}, this actor "
                             f"has value_head={self.value_head is not None} (actor.value_head must match)")
        if "reference" in held and self.reference is None:
            held.remove("reference")  # kl_coef is 0 now: the reference is not needed
        self._reshard()
        state = self._dcp_state(held)
        dcp.load(state, checkpoint_id=str(src / DCP_DIR))
        root = self._trainable()
        set_model_state_dict(root, state["model"])
        if "optim" in state:
            set_optimizer_state_dict(root, self.optimizer, state["optim"])
        if "reference" in state:
            set_model_state_dict(self.reference, state["reference"])
        if "sft_optim" in state:
            set_optimizer_state_dict(self.model, self.sft_optimizer, state["sft_optim"])
        extra = torch.load(src / ckpt.EXTRA_FILE, map_location="cpu", weights_only=False)
        self.scheduler.load_state_dict(extra["actor"]["scheduler"])
        self.step = int(extra["actor"]["step"])
        rng_file = src / RNG_DIR / f"rank{self.rank}.pt"
        if rng_file.is_file():  # a rank that did not exist when saved keeps its own RNG
            ckpt.set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
        dist.barrier()
        return dict(extra.get("trainer", {}))

    def get_step(self) -> int:
        return self.step

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
