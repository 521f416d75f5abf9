"""Test and drill support for the FSDP actor: probes that production ranks do not carry.

* :class:`DrillWorker` - an :class:`~unirl_fsdp.worker.FSDPWorker` with fault injection
  (``UNIRL_FSDP_INJECT_FAULT``), a full-gradient probe and a memory probe. Select it with
  ``actor.options.worker_cls: "fsdp_support:DrillWorker"`` (this directory on ``sys.path``; the actor
  hands its root to the ranks).
* :func:`loss_and_grads`, :func:`memory` - the driver side of those probes.
* ``unirl_before_backward`` - this module is also an in-process plugin (``load_kernel(extra=[("probe",
  fsdp_support)])``): it records every call to ``<run.output_dir>/probe-<pid>.jsonl``, which proves
  the one trainer kernel reaches every rank.

Benchmarks import it too (``benchmarks/fsdp_scaling.py``).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

from torch import Tensor

from unirl.api import StepInfo, hookimpl
from unirl_fsdp.worker import FSDPWorker

HERE = str(Path(__file__).resolve().parent)
WORKER_CLS = "fsdp_support:DrillWorker"

#: Fault injection for tests and drills: ``"<rank>:<method>[:<n>]"`` makes that rank exit its process in
#: the middle of the n-th call (default 1st) of ``method``: train_step/sft_step after the first backward,
#: save after writing its shards. Reaches the ranks through ``runtime.worker_env``.
FAULT_ENV = "UNIRL_FSDP_INJECT_FAULT"


def on_path() -> None:
    """Make this module importable by name (pytest's importlib mode does not add test dirs)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)


class DrillWorker(FSDPWorker):
    """FSDPWorker plus fault injection and probes (tests, drills, benchmarks only)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._rss_start_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self._rss_setup_kb = self._rss_start_kb
        fault = os.environ.get(FAULT_ENV, "").split(":")
        self._fault = fault[1] if len(fault) >= 2 and fault[0].strip() == str(self.rank) else ""
        self._fault_at = int(fault[2]) if len(fault) >= 3 else 1
        self._calls: dict[str, int] = {}
        self._armed = False

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        self._warm_imports()
        before = _reset_peak()
        out = super().setup(master_addr, master_port)
        self._rss_setup_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self._load_growth_kb = _status_kb("VmHWM") - before
        return out

    def _warm_imports(self) -> None:
        """Import the model's code before the load is measured: the first meta build imports transformers'
        modeling code (~165 MB of code and module state, the same for any model size), which is not the
        model's memory. The meta build itself holds nothing and is dropped."""
        import safetensors  # noqa: F401
        import torch.distributed.checkpoint.state_dict  # noqa: F401
        import torch.distributed.fsdp  # noqa: F401

        self.adapter.build_empty(self.config, self.tokenizer)

    def load_growth_mb(self) -> float:
        """How far this rank's RSS peaked above where it stood when setup began (the model's loading)."""
        return self._load_growth_kb / 1024

    def full_state(self) -> dict[str, Tensor] | None:
        """Every parameter and buffer of the policy, whole, by module name (rank 0; None elsewhere)."""
        self._reshard()
        out = {}
        for name, t in [*self.model.named_parameters(), *self.model.named_buffers()]:
            full = self._full(t.detach()).cpu().clone()
            if self.rank == 0:
                out[name] = full
        return out if self.rank == 0 else None

    # ------------------------------------------------------------------ fault injection
    def _due(self, where: str) -> bool:
        self._calls[where] = self._calls.get(where, 0) + 1
        return self._fault == where and self._calls[where] == self._fault_at

    def _armed_call(self, where: str, fn: Any, *args: Any) -> Any:
        self._armed = self._due(where)
        try:
            return fn(*args)
        finally:
            self._armed = False

    def train_step(self, *args: Any) -> dict[str, Any]:
        return self._armed_call("train_step", super().train_step, *args)

    def sft_step(self, *args: Any) -> dict[str, Any]:
        return self._armed_call("sft_step", super().sft_step, *args)

    def _backward(self, loss: Tensor) -> None:
        super()._backward(loss)
        if self._armed:
            os._exit(13)  # mid-step: after the first backward, before the optimizer step

    def _write_shards(self, tmp: Path) -> list[str]:
        states = super()._write_shards(tmp)
        if self._due("save"):
            os._exit(13)  # after this rank's shards, before meta.json and the rename
        return states

    # ------------------------------------------------------------------ probes
    def full_grads_after_backward(self, samples: list, batch: dict, total_tokens: float, total_seqs: float,
                                  num_micro: int, config: Any = None) -> dict[str, Any]:
        """Loss and full gradients of one step without the optimizer step (equivalence tests).
        ``config`` overrides the run config for this call only (e.g. another ``loss_agg``)."""
        config = config or self.config
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        micros = self._micro_batches(samples, batch, size=config.actor.micro_batch_size, count=num_micro)
        parts = self._accumulate(micros, StepInfo(), total_tokens=total_tokens, total_seqs=total_seqs,
                                 config=config)
        named = list(self.model.named_parameters())
        if self.value_head is not None:
            named += [(f"value_head.{n}", p) for n, p in self.value_head.named_parameters()]
        grads = {}
        for name, p in named:
            g = self._full(p.grad) if p.grad is not None else None
            if self.rank == 0 and g is not None:
                grads[name] = g.detach().cpu().clone()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": sum(p["loss"] for p in parts), "grads": grads if self.rank == 0 else None}

    def trainable(self) -> dict[str, list[str]]:
        """Names of the policy's parameters that require grad, and of those the RL optimizer holds."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        held = [names.get(id(p), "<not a policy parameter>") for g in self.optimizer.param_groups for p in g["params"]]
        return {"requires_grad": sorted(n for n, p in self.model.named_parameters() if p.requires_grad),
                "optimizer": sorted(held)}

    def memory(self) -> dict[str, float]:
        """Peak RSS of this process and the bytes this rank holds in params, grads and optimizer state."""
        def nbytes(t: Tensor) -> int:
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size()

        params = sum(nbytes(p) for p in self._train_params())
        optim = 0
        for st in self.optimizer.state.values():
            optim += sum(nbytes(v) for v in st.values() if isinstance(v, Tensor) and v.dim() > 0)
        return {"rank": self.rank, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "start_rss_mb": self._rss_start_kb / 1024, "setup_rss_mb": self._rss_setup_kb / 1024,
                "param_mb": params / 2**20, "optim_mb": optim / 2**20}


def _status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in kB (``VmRSS`` now, ``VmHWM`` its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> int:
    """Reset this process's peak RSS to its current RSS (``/proc/self/clear_refs`` 5, Linux) and return it."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS")


def loss_and_grads(actor: Any, samples: list, batch: dict, *, config: Any = None) -> tuple[float, dict[str, Tensor]]:
    """The step's total loss and full gradients (value head's prefixed ``value_head.``) of an FSDP actor
    running :class:`DrillWorker`, without updating. ``config`` overrides ``algorithm.*`` and
    ``actor.micro_batch_size`` for this call only."""
    args, _ = actor._plan(samples, batch, config.actor.micro_batch_size if config else None)
    outs = actor.group.call("full_grads_after_backward", per_rank=args, config=config)
    return sum(o["loss"] for o in outs), outs[0]["grads"]


def memory(actor: Any) -> list[dict[str, float]]:
    """Per-rank peak RSS and parameter/optimizer bytes of an FSDP actor running :class:`DrillWorker`."""
    return actor.group.call("memory")


# ------------------------------------------------------------------ the in-process probe plugin


@hookimpl
def unirl_before_backward(ctx: Any, config: Any) -> None:
    """Record what the hook saw, one JSON line per call, in a file of this process."""
    path = Path(config.run.output_dir) / f"probe-{os.getpid()}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = {"pid": os.getpid(), "rank": ctx.rank, "world_size": ctx.world_size, "rl_step": ctx.rl_step,
           "update": ctx.update, "micro_batch": ctx.micro_batch, "n_samples": len(ctx.samples),
           "ids": [s.id for s in ctx.samples], "n_logprobs": int(ctx.logprobs.numel()),
           "aligned": tuple(ctx.logprobs.shape) == tuple(ctx.rollout_logprobs.shape),
           "n_tokens": sum(len(s.response_ids) for s in ctx.samples),
           "detached": not ctx.logprobs.requires_grad}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def read_probe(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    out = []
    for p in sorted(Path(output_dir).glob("probe-*.jsonl")):
        out += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return out


class RaiseOnRank:
    """A picklable before-backward callback that raises on one rank only (the collective gate)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, ctx: Any) -> None:
        if ctx.rank == self.rank:
            raise RuntimeError(f"drift on rank {ctx.rank}")

