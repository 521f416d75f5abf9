"""The ``fsdp`` actor: the embedded actor's contract, served by a group of FSDP2 ranks on Ray.

The driver owns the *policy* of a step and the ranks own the *math*:

* the driver shards the batch over ranks balancing tokens (:func:`unirl.samples.split`; siblings stay
  together when a group estimator is in use), computes the step's global loss denominators once over
  the whole batch (:func:`unirl.actor.torch_actor.step_denominators`, the embedded actor's function), and
  tells every rank how many micro-batches the busiest rank has, so that all ranks run the same number of
  collectives;
* each rank runs the embedded actor's :func:`~unirl.actor.torch_actor.micro_batch_loss` on its shard
  (see :mod:`unirl_fsdp.worker`), and FSDP sums the gradients;
* metrics come back as micro-batch parts and are reduced with the embedded actor's
  :func:`~unirl.actor.torch_actor.reduce_metrics` (sum, or max for ``ratio_max``).

So for the same data, the loss, the gradients and the update equal the embedded actor's up to float
summation order, however many ranks or micro-batches there are (``tests/test_fsdp_actor.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from unirl.actor.torch_actor import reduce_metrics, step_denominators
from unirl.config import RunConfig
from unirl.contracts import Actor, ModelAdapter
from unirl.samples import Sample, split
from unirl_fsdp.group import RankGroup
from unirl_fsdp.options import FSDPOptions

#: Estimators whose statistics are per group of siblings: keep a group on one rank by default.
GROUP_ESTIMATORS = frozenset({"grpo", "dr_grpo", "rloo"})


def plugin_worker_env(config: RunConfig) -> dict[str, str]:
    """Every installed plugin's ``unirl_worker_env`` answer, merged by core (a variable set two ways is
    an error naming both plugins): used when the trainer did not pass ``worker_env``."""
    from unirl.kernel import load_kernel
    from unirl.preflight import worker_env

    return worker_env(config, load_kernel())


def _resolve_device(options: FSDPOptions) -> tuple[str, str]:
    import ray

    device = options.device
    if device == "auto":
        device = "cuda" if ray.cluster_resources().get("GPU", 0) >= options.world_size else "cpu"
    backend = options.backend
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    return device, backend


class FSDPActor(Actor):
    """Actor contract over ``world_size`` FSDP2 ranks (Ray actors). Options: :class:`FSDPOptions`."""

    Config = FSDPOptions

    def __init__(self, *, config: RunConfig, adapter: ModelAdapter, tokenizer: Any = None,
                 model: torch.nn.Module | None = None, worker_env: Mapping[str, str] | None = None,
                 options: FSDPOptions | Mapping[str, Any] | None = None, before_backward: Any = None) -> None:
        self.config = config
        if isinstance(options, FSDPOptions):
            self.options = options
        else:
            self.options = FSDPOptions.model_validate(dict(options if options is not None else config.actor.options))
        if tokenizer is None:  # export_hf writes it next to the weights
            tokenizer = adapter.build_tokenizer(config)
        self.tokenizer = tokenizer
        self.worker_env = dict(worker_env) if worker_env is not None else plugin_worker_env(config)
        opts = self.options
        if opts.keep_groups is not None:
            self.keep_groups = opts.keep_groups
        else:
            self.keep_groups = config.algorithm.estimator in GROUP_ESTIMATORS
        self.step = 0
        self._group: RankGroup | None = None
        import ray

        from unirl_fsdp.group import _connect_ray

        self._owns_ray = _connect_ray(opts)  # before _resolve_device, which asks the cluster
        try:
            self.device, self.backend = _resolve_device(opts)
            model_ref = ray.put(model) if model is not None else None
            self._group = RankGroup(
                options=opts, worker_env=self.worker_env, device=self.device,
                worker_kwargs=dict(config=config, adapter=adapter, tokenizer=tokenizer, model=model_ref,
                                   options=opts, device=self.device, backend=self.backend,
                                   before_backward=before_backward),
            )
        except BaseException:
            self.close()
            raise
        self.num_params = int(self._group.setup[0]["params"])

    # ------------------------------------------------------------------ plumbing
    @property
    def group(self) -> RankGroup:
        if self._group is None:
            raise RuntimeError("the fsdp actor is closed")
        return self._group

    @property
    def world_size(self) -> int:
        return self.options.world_size

    def _shard(self, samples: Sequence[Sample], *, keep_groups: bool | None = None) -> list[list[int]]:
        """Indices of each rank's samples, balanced by tokens (same order as given within a rank)."""
        keep = self.keep_groups if keep_groups is None else keep_groups
        index = {id(s): i for i, s in enumerate(samples)}
        parts = split(samples, self.world_size, keep_groups=keep)
        return [sorted(index[id(s)] for s in part) for part in parts]

    def _num_micro(self, shards: Sequence[Sequence[int]], mbs: int | None = None) -> int:
        mbs = mbs or self.config.actor.micro_batch_size
        return max(1, max(math.ceil(len(s) / mbs) for s in shards))

    def _replay(self, method: str, samples: list[Sample]) -> list[Tensor]:
        if not samples:
            return []
        shards = self._shard(samples, keep_groups=False)  # replay needs no groups: balance tokens only
        n = self._num_micro(shards)
        outs = self.group.call(method, per_rank=[([samples[i] for i in idx], n) for idx in shards])
        result: list[Tensor | None] = [None] * len(samples)
        for idx, out in zip(shards, outs, strict=True):
            for i, t in zip(idx, out, strict=True):
                result[i] = t
        return result  # type: ignore[return-value]

    def _split_batch(self, batch: Mapping[str, Sequence[Tensor] | None], shards: Sequence[Sequence[int]],
                     n: int) -> list[dict[str, list[Tensor] | None]]:
        for k, v in batch.items():
            if v is not None and len(v) != n:
                raise ValueError(f"batch[{k!r}] has {len(v)} entries for {n} samples")
        return [{k: ([v[i] for i in idx] if v is not None else None) for k, v in batch.items()} for idx in shards]

    # ------------------------------------------------------------------ Actor contract
    def logprobs(self, samples: list[Sample]) -> list[Tensor]:
        return self._replay("logprobs", samples)

    def values(self, samples: list[Sample]) -> list[Tensor]:
        if not self.config.actor.value_head:
            return super().values(samples)
        return self._replay("values", samples)

    def ref_logprobs(self, samples: list[Sample]) -> list[Tensor]:
        if self.config.algorithm.kl_coef <= 0:
            raise RuntimeError("no reference policy (algorithm.kl_coef is 0)")
        return self._replay("ref_logprobs", samples)

    def snapshot_reference(self) -> None:
        self.group.call("snapshot_reference")

    def _plan(self, samples: list[Sample], batch: Mapping[str, Sequence[Tensor] | None], mbs: int | None = None):
        if not samples:
            raise ValueError("train_step needs at least one sample")
        for key in ("old_logprobs", "advantages"):
            if batch.get(key) is None:
                raise ValueError(f"train_step needs batch[{key!r}]")
        shards = self._shard(samples)
        per_rank_batch = self._split_batch(batch, shards, len(samples))
        keys = [k for k, v in batch.items() if v is not None]
        total_tokens, total_seqs = step_denominators(samples)
        n = self._num_micro(shards, mbs)
        args = [([samples[i] for i in idx], per_rank_batch[r], keys, total_tokens, total_seqs, n)
                for r, idx in enumerate(shards)]
        return args, total_tokens

    def train_step(self, samples: list[Sample], batch: dict[str, list[Tensor]]) -> dict[str, float]:
        args, total_tokens = self._plan(samples, batch)
        outs = self.group.call("train_step", per_rank=args)
        self.step += 1
        out = reduce_metrics([p for o in outs for p in o["parts"]])
        out.update(grad_norm=outs[0]["grad_norm"], lr=outs[0]["lr"], tokens=total_tokens)
        return out

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """One supervised step (cross-entropy on response tokens) with its own AdamW at ``sft.lr``."""
        if not samples:
            raise ValueError("sft_step needs at least one sample")
        shards = self._shard(samples, keep_groups=False)
        total_tokens, _ = step_denominators(samples)
        n = self._num_micro(shards)
        outs = self.group.call("sft_step", per_rank=[([samples[i] for i in idx], total_tokens, n)
                                                     for idx in shards])
        out = reduce_metrics([p for o in outs for p in o["parts"]])
        out.update(grad_norm=outs[0]["grad_norm"], lr=outs[0]["lr"], tokens=total_tokens)
        return out

    def loss_and_grads(self, samples: list[Sample], batch: dict[str, list[Tensor]], *,
                       config: RunConfig | None = None) -> tuple[float, dict[str, Tensor]]:
        """The step's total loss and full gradients (value head's prefixed ``value_head.``), without
        updating: for equivalence tests and debugging. ``config`` overrides the run config for this
        call only (``algorithm.*``, ``actor.micro_batch_size``)."""
        args, _ = self._plan(samples, batch, config.actor.micro_batch_size if config else None)
        outs = self.group.call("full_grads_after_backward", per_rank=args, config=config)
        return sum(o["loss"] for o in outs), outs[0]["grads"]

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full weights in HF names, streamed in buckets of ``bucket_mb``: every rank gathers, rank 0
        sends. Names, order and tied-weight handling match the embedded actor's ``named_weights``.
        Consume the iterator to the end: abandoning it mid-way leaves ranks inside a collective, so the
        group is stopped."""
        bucket_bytes = int(self.options.bucket_mb * 2**20)
        for bucket in self.group.stream("weight_buckets", bucket_bytes):
            yield from bucket

    def export_hf(self, path: str) -> None:
        self.group.call("export_hf", str(path))

    def save(self, path: str, extra: Mapping[str, Any] | None = None) -> None:
        """Atomic sharded checkpoint (``torch.distributed.checkpoint``) plus the trainer's ``extra``;
        loadable with any world size."""
        self.group.call("save", str(path), dict(extra or {}))

    def load(self, path: str) -> dict[str, Any]:
        """Restore a checkpoint (or the one ``path/latest`` names); return the trainer's ``extra``."""
        extras = self.group.call("load", str(path))
        self.step = int(self.group.call_rank(0, "get_step"))
        return extras[0]

    def memory(self) -> list[dict[str, float]]:
        """Per-rank peak RSS and parameter/optimizer bytes (benchmarks)."""
        return self.group.call("memory")

    def close(self) -> None:
        """Kill the ranks and, when this actor started Ray, stop it. Safe to call twice."""
        if self._group is not None:
            self._group.shutdown()
            self._group = None
        if getattr(self, "_owns_ray", False):
            import ray

            if ray.is_initialized():
                ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> FSDPActor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
