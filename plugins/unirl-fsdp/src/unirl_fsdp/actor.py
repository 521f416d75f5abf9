"""The ``fsdp`` actor: the embedded actor's contract, served by a group of FSDP2 ranks on Ray.

The driver owns the *policy* of a step and the ranks own the *math*:

* the driver shards the batch over ranks balancing tokens (:func:`unirl.samples.split`; siblings stay
  together when the run's estimator declares ``needs_groups``), computes the step's global loss
  denominators once over the whole batch (:func:`unirl.actor.skeleton.step_denominators`), and tells
  every rank how many micro-batches the busiest rank has, so that all ranks run the same number of
  collectives;
* each rank is the embedded actor's skeleton (:class:`unirl.actor.skeleton.ActorSkeleton`) plus
  distribution (see :mod:`unirl_fsdp.worker`), and FSDP sums the gradients;
* metrics come back as micro-batch parts and are reduced with the loss's ``runtime.metric_reduce``.

One kernel per run: nothing here or in a rank builds a kernel of its own. The trainer's
:class:`unirl.runtime.Runtime` is pickled into every rank (its policy loss, parity context and the
hooks that rebuild the trainer's plugin set), and the before-backward callback installed with
:meth:`FSDPActor.set_before_backward` is shipped the same way.

So for the same data, the loss, the gradients and the update equal the embedded actor's up to float
summation order, however many ranks or micro-batches there are (``tests/test_fsdp_actor.py``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from unirl.api import (
    CHECKPOINT_EXTRA_FILE,
    CHECKPOINT_META_FILE,
    ActorInputError,
    BeforeBackward,
    ModelAdapter,
    RunConfig,
    Sample,
    StepInfo,
    UniRLError,
    check_adapter_shapes,
    check_base,
    check_checkpoint_kind,
    check_samples,
    micro_batch_bounds,
    resolve_checkpoint,
    split,
    step_denominators,
    step_metrics,
)
from unirl_fsdp.declaration import FSDPDeclaration
from unirl_fsdp.group import RankGroup
from unirl_fsdp.options import FSDPOptions
from unirl_fsdp.worker import FORMAT

if TYPE_CHECKING:  # pragma: no cover
    from unirl.api import Runtime


class UnpicklableCallbackError(UniRLError, TypeError):
    """What the FSDP actor must ship to its ranks (runtime, before-backward callback) does not pickle."""


def ship(obj: Any, what: str) -> bytes | None:
    """``obj`` pickled with Ray's cloudpickle for the ranks, or a clear error naming ``what``."""
    if obj is None:
        return None
    import ray.cloudpickle as cloudpickle

    try:
        return cloudpickle.dumps(obj)
    except Exception as exc:  # noqa: BLE001 - any pickling failure
        raise UnpicklableCallbackError(
            f"the fsdp actor runs {what} on every rank (a Ray process), but {obj!r} cannot be pickled "
            f"({type(exc).__name__}: {exc}). Fix: use runtime.before_backward() (a picklable HookGate), "
            "or a module-level function / an object whose state pickles (no locks, open files, "
            "generators or CUDA handles in its closure)") from exc


def _sys_path(runtime: Runtime) -> list[str]:
    """The sys.path roots of the trainer's in-process plugins: the ranks must import them."""
    spec = getattr(getattr(runtime, "hooks", None), "spec", None)
    return [root for _, _, root in getattr(spec, "extras", ())]


def _resolve_device(options: FSDPOptions) -> tuple[str, str]:
    import ray

    device = options.device
    if device == "auto":
        device = "cuda" if ray.cluster_resources().get("GPU", 0) >= options.world_size else "cpu"
    backend = options.backend
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    return device, backend


def check_lora_checkpoint(path: str, *, lora_base: str | None, adapter_shapes: Mapping[str, Sequence[int]]) -> None:
    """What an FSDP checkpoint must match for this actor to load it, read from its ``meta.json`` and
    ``extra.pt``: adapter-only with ``actor.lora`` (full weights without), the same adapter tensors
    (``actor.lora.r`` / ``target_modules``), and the same base (:func:`unirl.actor.lora.check_base`)."""
    import json

    src = resolve_checkpoint(path)
    meta = json.loads((src / CHECKPOINT_META_FILE).read_text())
    if meta.get("format") != FORMAT:
        return  # the ranks refuse it, naming the actor that reads it
    held = meta.get("adapter")
    check_checkpoint_kind(src, adapter_only=lora_base is not None, holds_adapter=bool(held))
    if lora_base is None:
        return
    check_adapter_shapes(adapter_shapes, held, f"checkpoint {src}")
    extra = torch.load(src / CHECKPOINT_EXTRA_FILE, map_location="cpu", weights_only=False)
    check_base(str(src), extra["actor"].get("lora_base"), lora_base)


class FSDPActor(FSDPDeclaration):
    """Actor contract over ``world_size`` FSDP2 ranks (Ray actors). Options: :class:`FSDPOptions`."""

    # Config, capabilities and memory_layout: its declaration (unirl_fsdp.declaration), which the plan reads
    # without importing this module
    keeps_versions = True  # each rank keeps its own shards of a version (unirl.actor.held_versions)

    def __init__(self, *, config: RunConfig, adapter: ModelAdapter, runtime: Runtime, options: FSDPOptions,
                 tokenizer: Any = None, model: torch.nn.Module | None = None) -> None:
        """``options``: ``actor.options`` as the kernel validated it (build with ``Kernel.build``, or
        ``unirl.api.build_actor`` in a test); ``runtime``: the trainer's, always passed."""
        self.config = config
        self.options = options
        self.runtime = runtime
        if tokenizer is None:  # export_hf writes it next to the weights
            tokenizer = adapter.build_tokenizer(config)
        self.tokenizer = tokenizer
        opts = self.options
        self.keep_groups = opts.keep_groups if opts.keep_groups is not None else runtime.estimator.needs_groups
        self.step = 0
        self.before_backward: BeforeBackward | None = None
        self._group: RankGroup | None = None
        runtime_blob = ship(runtime, "the run's runtime (policy loss, parity provider, plugin hooks)")
        import ray

        from unirl_fsdp.group import _connect_ray

        self._owns_ray = _connect_ray(opts)  # before _resolve_device, which asks the cluster
        try:
            self.device, self.backend = _resolve_device(opts)
            model_ref = ray.put(model) if model is not None else None
            roots = _sys_path(runtime)
            self._group = RankGroup(
                options=opts, worker_env=dict(runtime.worker_env), device=self.device, sys_path=roots,
                worker_kwargs=dict(config=config, adapter=adapter, tokenizer=tokenizer, model=model_ref,
                                   options=opts, device=self.device, backend=self.backend,
                                   runtime=runtime_blob, sys_path=roots),
            )
        except BaseException:
            self.close()
            raise
        self.num_params = int(self._group.setup[0]["params"])
        #: with actor.lora: the base fingerprint and adapter shapes the ranks built (checked on load)
        self.lora_base: str | None = self._group.setup[0]["lora_base"]
        self.adapter_shapes: dict[str, list[int]] = self._group.setup[0]["adapter_shapes"]
        self._frozen = {n: tuple(s) for n, s in self._group.setup[0]["frozen"].items()}

    def set_before_backward(self, callback: BeforeBackward | None) -> None:
        """Ship ``callback`` to every rank, where it runs on the rank's own micro-batches (a failure on
        any rank makes every rank raise). It must pickle: the trainer's ``runtime.before_backward()``
        does."""
        blob = ship(callback, "the before-backward callback")
        self.group.call("set_before_backward", blob)
        self.before_backward = callback

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

    def _num_micro(self, samples: Sequence[Sample], shards: Sequence[Sequence[int]], mbs: int | None = None) -> int:
        """The busiest rank's micro-batch count: every rank runs that many forwards (the collectives
        pair up), cut as the ranks cut them (:func:`micro_batch_bounds`)."""
        mbs = mbs or self.config.actor.micro_batch_size
        tokens = self.config.actor.micro_batch_tokens
        return max(1, max(len(micro_batch_bounds([samples[i] for i in s], mbs, tokens)) for s in shards))

    def _replay(self, method: str, samples: list[Sample], *extra: Any) -> list[Tensor]:
        if not samples:
            return []
        shards = self._shard(samples, keep_groups=False)  # replay needs no groups: balance tokens only
        n = self._num_micro(samples, shards)
        outs = self.group.call(method, per_rank=[([samples[i] for i in idx], n, *extra) for idx in shards])
        result: list[Tensor | None] = [None] * len(samples)
        for idx, out in zip(shards, outs, strict=True):
            for i, t in zip(idx, out, strict=True):
                result[i] = t
        return result  # type: ignore[return-value]

    def _split_batch(self, batch: Mapping[str, Sequence[Tensor] | None], shards: Sequence[Sequence[int]],
                     n: int) -> list[dict[str, list[Tensor] | None]]:
        for k, v in batch.items():
            if v is not None and len(v) != n:
                raise ActorInputError(f"batch[{k!r}] has {len(v)} entries for {n} samples: one tensor per sample")
        return [{k: ([v[i] for i in idx] if v is not None else None) for k, v in batch.items()} for idx in shards]

    # ------------------------------------------------------------------ Actor contract
    def logprobs(self, samples: list[Sample]) -> list[Tensor]:
        return self._replay("logprobs", samples)

    def hold_version(self, version: int, keep: Collection[int]) -> None:
        """Every rank keeps its own shards of the version on the CPU (unirl.actor.held_versions)."""
        self.group.call("hold_version", version, sorted(keep))

    def logprobs_at(self, version: int, samples: list[Sample]) -> list[Tensor]:
        return self._replay("logprobs_at", samples, version)

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
        check_samples(samples, "train_step")
        for key in ("advantages",):  # no old_logprobs: each forward's own log-probs are pi_old
            if batch.get(key) is None:
                raise ActorInputError(f"train_step needs batch[{key!r}] (the trainer computes it; a custom "
                                      "loop must pass it)")
        shards = self._shard(samples)
        per_rank_batch = self._split_batch(batch, shards, len(samples))
        total_tokens, total_seqs = step_denominators(samples)
        n = self._num_micro(samples, shards, mbs)
        args = [([samples[i] for i in idx], per_rank_batch[r], total_tokens, total_seqs, n)
                for r, idx in enumerate(shards)]
        return args, total_tokens

    def train_step(self, samples: list[Sample], batch: dict[str, list[Tensor]],
                   info: StepInfo = StepInfo()) -> dict[str, float]:
        args, total_tokens = self._plan(samples, batch)
        outs = self.group.call("train_step", per_rank=[(*a, info) for a in args])
        self.step += 1
        return step_metrics(outs, self.runtime.metric_reduce, tokens=total_tokens)

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """One supervised step (cross-entropy on response tokens) with its own AdamW at ``sft.lr``."""
        check_samples(samples, "sft_step")
        shards = self._shard(samples, keep_groups=False)
        total_tokens, _ = step_denominators(samples)
        n = self._num_micro(samples, shards)
        outs = self.group.call("sft_step", per_rank=[([samples[i] for i in idx], total_tokens, n)
                                                     for idx in shards])
        return step_metrics(outs, self.runtime.metric_reduce, tokens=total_tokens)

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full weights in HF names, streamed in buckets of ``bucket_mb``: every rank gathers, rank 0
        sends. Names, order and tied-weight handling match the embedded actor's ``named_weights``.
        Consume the iterator to the end: abandoning it mid-way leaves ranks inside a collective, so the
        group is stopped."""
        bucket_bytes = int(self.options.bucket_mb * 2**20)
        for bucket in self.group.stream("weight_buckets", bucket_bytes):
            yield from bucket

    def frozen_weights(self) -> dict[str, tuple[int, ...]]:
        """The ``actor.freeze`` parts (frozen on every rank at setup; full shapes), sent once by a weight
        sync; none under ``actor.lora`` (the merged weights it streams are the ones an adapter may touch)."""
        return {} if self.lora_base is not None else dict(self._frozen)

    def export_hf(self, path: str) -> None:
        """The HF directory (with ``actor.lora``: the merged model), written by rank 0."""
        self.group.call("export_hf", str(path))

    def export_adapter(self, path: str) -> None:
        """The LoRA adapter alone as a peft directory (``unirl export --adapter``), written by rank 0."""
        if self.lora_base is None:
            super().export_adapter(path)
        self.group.call("export_adapter", str(path))

    def save(self, path: str, extra: Mapping[str, Any] | None = None) -> str:
        """Atomic sharded checkpoint (``torch.distributed.checkpoint``) plus the trainer's ``extra``;
        loadable with any world size. Returns the checkpoint directory."""
        return self.group.call("save", str(path), dict(extra or {}))[0]

    def load(self, path: str) -> dict[str, Any]:
        """Restore a checkpoint (or the one ``path/latest`` names); return the trainer's ``extra``. A
        checkpoint of the other kind (adapter vs full weights), of another adapter shape or of another
        LoRA base is refused here, before any rank loads (the ranks would fail as a group)."""
        check_lora_checkpoint(path, lora_base=self.lora_base, adapter_shapes=self.adapter_shapes)
        extras = self.group.call("load", str(path))
        self.step = int(self.group.call_rank(0, "get_step"))
        return extras[0]

    def memory_peaks(self) -> list[Any]:
        """Each rank's peak memory since the last call, in rank order (:mod:`unirl_fsdp.memory`)."""
        from unirl_fsdp.memory import group_peaks

        return group_peaks(self.group)

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
