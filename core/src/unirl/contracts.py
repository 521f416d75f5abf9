"""The contracts every engine, actor, weight-sync transport and model adapter serves.

Several implementations exist for each (embedded torch, vLLM, SGLang; embedded actor, FSDP), so each
contract is written once here as an abstract class, with the *why* of every method. Types only: no
torch import at module load (tensors appear in annotations as strings).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from unirl.kernel.errors import ConfigError, WeightSyncError
from unirl.memory import MemoryPeak
from unirl.samples import Sample

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    import torch
    from transformers import PretrainedConfig

    from unirl.config import RunConfig
    from unirl.memory_plan.layout import MemoryLayout, ModelFacts
    from unirl.weights import Staged


@dataclass(frozen=True)
class SamplingParams:
    """What an engine needs to sample one model turn; built from ``rollout.*`` by the trainer.

    ``max_new_tokens`` caps one turn. ``max_response_tokens`` (None: no cap) caps the whole response of
    a trajectory, observations included, so an agentic loop cannot grow without bound: a continuation
    generates at most :meth:`new_token_limit` tokens. ``stop`` strings end a turn like stop token ids.
    ``ignore_eos`` keeps generating past the eos token (the model's and the tokenizer's; explicit
    ``stop_token_ids`` other than eos and ``stop`` strings still end a turn), so a fixed-length
    benchmark is possible on every engine; ``min_new_tokens`` suppresses eos and the stop token ids
    (never the stop strings: no engine can un-write text) until that many tokens of the turn exist.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    max_response_tokens: int | None = None
    logprobs: bool = True  # return the sampled tokens' fp32 log-probs
    ignore_eos: bool = False
    min_new_tokens: int = 0

    @classmethod
    def from_config(cls, config: RunConfig, stop_token_ids: Iterable[int] = (), **changes: Any) -> SamplingParams:
        r = config.rollout
        base = dict(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                    top_k=r.top_k, stop_token_ids=tuple(stop_token_ids), stop=tuple(r.stop),
                    max_response_tokens=r.max_response_tokens, ignore_eos=r.ignore_eos,
                    min_new_tokens=r.min_new_tokens)
        base.update(changes)
        return cls(**base)

    def new_token_limit(self, sample: Sample) -> int:
        """Tokens the next turn of ``sample`` may generate (0: its budget is spent)."""
        if self.max_response_tokens is None:
            return self.max_new_tokens
        return max(0, min(self.max_new_tokens, self.max_response_tokens - len(sample.response_ids)))


def stop_token_ids(config: RunConfig, tokenizer: Any) -> list[int]:
    """eos, the chat template's end-of-turn token under ``data.chat_template``, plus every ``rollout.stop``
    string that is one token: what :meth:`SamplingParams.from_config`
    takes as ``stop_token_ids``. Longer strings end a turn as text: they reach the engine as
    ``SamplingParams.stop`` (``from_config`` passes all of them)."""
    from unirl.kernel.errors import ConfigError

    ids = [tokenizer.eos_token_id]
    if config.data.chat_template:  # a chat turn ends with the template's end-of-turn token (<|im_end|> ...)
        from unirl.data.chat import end_of_turn_id

        eot = end_of_turn_id(tokenizer)
        if eot is not None and eot not in ids:
            ids.append(eot)
    for i, text in enumerate(config.rollout.stop):
        enc = tokenizer.encode(text, add_special_tokens=False)
        if not enc:
            raise ConfigError(f"rollout.stop[{i}]: {text!r} encodes to no tokens; fix: remove it or give text")
        if len(enc) == 1:
            ids.append(enc[0])
    return ids


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do, declared by its class so preflight checks pairings before it is built.

    * ``weight_syncs``: the ``weight_sync.name`` transports that can load into it;
    * ``logprobs``: "raw" (log_softmax of the unprocessed logits) or "processed" (after temperature,
      top-k, top-p: :mod:`unirl.logprobs`); preflight requires it to equal ``rollout.logprobs``, the
      distribution the actor replays, so either may stand in for pi_old (``old_logp_source: rollout``);
    * ``continuation``: a sample whose response holds earlier turns continues from its full context;
    * ``async_submit``: ``submit`` returns before the generation ends (else it runs to completion inside
      ``submit`` and ``poll`` only hands the results back);
    * ``lora_adapters``: :meth:`RolloutEngine.load_adapter` serves a peft LoRA adapter on top of the
      engine's base weights, so ``actor.lora.sync: adapter`` may publish the adapter alone;
    * ``requests_across_sync``: what of the submitted work survives a weight load while paused
      (``rollout.mode: stream``, docs/async.md). ``"queued"``: after :meth:`RolloutEngine.pause` and
      :meth:`RolloutEngine.wait_running`, ``load_weights`` is accepted with requests queued (they keep their
      place and start under the new weights) or finished and not yet reaped (their tokens keep the
      version they were sampled under); ``"none"``: nothing may be in flight, so stream mode is refused.
    """

    weight_syncs: tuple[str, ...]
    logprobs: Literal["raw", "processed"] = "raw"
    continuation: bool = True
    async_submit: bool = True
    lora_adapters: bool = False
    requests_across_sync: Literal["none", "queued"] = "none"


@dataclass(frozen=True)
class Handle:
    """One ``submit``: its id and the ids of its samples (what ``poll(handle)`` waits for)."""

    id: int
    sample_ids: tuple[str, ...]


@dataclass(frozen=True)
class Receipt:
    """One engine worker's answer to a weight sync: what it loaded, fingerprinted."""

    worker: int
    version: int
    fingerprint: str
    num_tensors: int = 0
    seconds: float = 0.0
    #: how the bytes reached this worker (:mod:`unirl.sync.transport`: inprocess, shm, object_store; an
    #: HTTP engine names its own, e.g. SGLang's disk or nccl)
    transport: str = "inprocess"
    node: str | None = None  # where the worker runs: its Ray node id, or a server URL (None: this process)
    #: the worker's tensor-parallel rank inside its engine (None: the engine has no TP)
    tp_rank: int | None = None
    #: fingerprint of the parameters the worker holds after the load (its TP shard, as vLLM's weight
    #: loaders cut it); ``fingerprint`` is of the full tensors it received, the one every rank must share
    shard_fingerprint: str | None = None


@dataclass
class VersionLedger:
    """The policy version the engines serve. Only a committed sync advances it."""

    version: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)

    def commit(self, version: int, receipts: list[Receipt], manifest_fingerprint: str) -> None:
        verify_receipts(version, receipts, manifest_fingerprint)
        self.version = version
        self.history.append({"version": version, "fingerprint": manifest_fingerprint,
                             "workers": [r.worker for r in receipts],
                             "transports": sorted({r.transport for r in receipts})})


def verify_receipts(version: int, receipts: list[Receipt], manifest_fingerprint: str) -> None:
    """Raise :class:`WeightSyncError` unless every worker received exactly the sender's manifest.

    The trainer's :class:`VersionLedger` commits through this, and an engine that restores its old
    weights on a mismatch checks with it too; neither keeps a second ledger."""
    bad = [r for r in receipts if r.fingerprint != manifest_fingerprint or r.version != version]
    if not receipts or bad:
        raise WeightSyncError(
            f"weight sync to version {version} not committed: "
            + (f"{len(bad)} of {len(receipts)} receipts disagree with the sender's manifest "
               f"({manifest_fingerprint[:12]}): {bad}" if receipts else "no receipts")
        )


def fingerprint(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over the ordered (name, shape, dtype, bytes) of tensors: the receipt's oracle.

    Sender and receiver compute it independently; equal fingerprints prove the bytes arrived.
    """
    import torch

    h = hashlib.sha256()
    for name, t in named_tensors:
        t = t.detach().contiguous().cpu()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(-1).view(torch.uint8).numpy())  # the buffer itself: no bytes copy
    return h.hexdigest()


#: the tensors file of a peft adapter directory (``save_pretrained``)
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_fingerprint(path: str) -> str:
    """:func:`fingerprint` of the tensors in the peft adapter directory ``path``, in sorted name order:
    what the sender wrote and what an engine was given must agree (the adapter sync's receipt). It covers
    the adapter file's tensors, not the engine's internal copy of them nor its base weights."""
    import os

    from safetensors.torch import load_file

    tensors = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    return fingerprint(sorted(tensors.items()))


#: keywords every transformers config constructor still converts (rope_* into ``rope_parameters``,
#: ``torch_dtype`` into ``dtype``, ``num_labels`` into the label maps) though they are not fields
_LEGACY_CONFIG_KEYS = frozenset({"rope_theta", "rope_scaling", "torch_dtype", "num_labels"})


def hf_config_keys(config_class: type) -> frozenset[str]:
    """The keywords a transformers config class takes: its constructor's named parameters (its own and
    its bases'), the aliases of its ``attribute_map``, and the legacy keywords it converts."""
    import inspect

    keys: set[str] = set(_LEGACY_CONFIG_KEYS)
    for cls in config_class.__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None:
            keys.update(name for name, p in inspect.signature(init).parameters.items()
                        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        keys.update(getattr(cls, "attribute_map", None) or {})
    return frozenset(keys)


class ModelAdapter(ABC):
    """How to build, tokenize and rename one model family. Third-party models ship one of these.

    The default ``qwen3`` adapter lives in :mod:`unirl.models.qwen3`.
    """

    name: str = ""
    parity_adapter: str | None = None  # name of the parity provider that applies, if any
    #: the HF ``model_type`` values of a ``model.path`` this adapter builds; preflight refuses any other
    #: before a model is loaded (empty: the adapter accepts any, and no check is made)
    model_types: tuple[str, ...] = ()

    @abstractmethod
    def build_model(self, config: RunConfig, tokenizer: Any = None) -> torch.nn.Module:
        """A transformers causal LM, from ``model.path`` or from scratch (``model.build``, sized to
        ``tokenizer``'s vocabulary). Same config + seed gives the same weights."""

    def build_empty(self, config: RunConfig, tokenizer: Any = None) -> torch.nn.Module | None:
        """:meth:`build_model`'s module tree with every tensor on the meta device (no memory, no values),
        or None when this adapter has no such build (the default).

        Why: a sharded actor (FSDP) builds this, shards it and fills only its own shards from
        ``model.path``, so no rank ever holds the whole model; with None every rank builds the whole
        model through :meth:`build_model` before sharding it, as before. The tree must be what
        :meth:`build_model` returns (class, parameter names, shapes), in fp32: an adapter whose
        :meth:`build_model` does more than construct the transformers model keeps the default."""
        return None

    @abstractmethod
    def build_tokenizer(self, config: RunConfig) -> Any:
        """A ``transformers.PreTrainedTokenizerFast`` (pad, eos set)."""

    @abstractmethod
    def hf_config(self, config: RunConfig) -> PretrainedConfig:
        """The transformers config of the model this run will build or load (no weights).

        Preflight and engine plugins read architecture facts from it (``head_dim``, layer count, tied
        embeddings) instead of special-casing adapter names."""

    def build_keys(self, config: RunConfig) -> frozenset[str] | None:
        """The keys ``model.build`` may set, or None to accept any (no check).

        Why: a transformers config stores an unknown keyword as a plain attribute that no layer reads,
        so a misspelt key (``num_experts_total``) would build the default architecture silently;
        preflight checks ``model.build`` against this set, with a did-you-mean. The default reads the
        constructor of the config class :meth:`hf_config` returns (:func:`hf_config_keys`); an adapter
        whose builder accepts more (its own defaults, extra attributes its modeling code reads) adds them."""
        try:
            hf = self.hf_config(config)
        except Exception:  # noqa: BLE001 - a build that does not construct is reported by preflight itself
            return None
        return hf_config_keys(type(hf))

    def engine_weight_name(self, name: str, engine: str) -> str:
        """Map an actor parameter name to what ``engine`` expects (identity for HF-format engines)."""
        return name

    def engine_weights(self, name: str, tensor: torch.Tensor, engine: str) -> list[tuple[str, torch.Tensor]]:
        """One actor tensor as ``engine``'s checkpoint holds it: one renamed tensor by default
        (:meth:`engine_weight_name`); a family whose checkpoint splits a fused parameter (transformers 5
        keeps MoE experts fused in memory, per expert on disk) returns the pieces."""
        return [(self.engine_weight_name(name, engine), tensor)]

    def engine_args(self, engine: str, config: RunConfig) -> dict[str, Any]:
        """Extra engine constructor arguments this model needs (e.g. vLLM's ``max_model_len``)."""
        return {}


class RolloutEngine(ABC):
    """Generates model turns for sample slots. Loops the engine dictates (batching, KV cache) live here.

    The contract is non-blocking: :meth:`submit` queues samples and returns a :class:`Handle`,
    :meth:`poll` hands back completed samples, :meth:`abort` ends in-flight requests early.
    :meth:`generate` is the blocking form built on them. Built as ``factory(config=, adapter=,
    tokenizer=, runtime=unirl.runtime.Runtime, options=Config | None)``: ``options`` is
    ``rollout.options`` as the kernel validated it against the class's ``Config`` (None: it declares
    none), and ``runtime`` is required. :meth:`pause` stops new work from starting
    (in-flight requests finish); :meth:`load_weights` raises
    :class:`~unirl.kernel.errors.SyncRefusedError` while anything is in flight.

    A submitted sample is filled **in place**: one model turn is appended to its response
    (:meth:`Sample.append_model_turn`: loss mask 1, fp32 log-probs of the sampled tokens under
    ``rollout.logprobs``: ``log_softmax(logits)``, raw or after temperature / top-k / top-p in vLLM's
    order (:mod:`unirl.logprobs`), the served ``weight_version``), with a
    :class:`~unirl.samples.RequestRecord` (timing, worker). A sample whose response already holds turns
    and observations continues from ``prompt_ids + response_ids``. The turn samples with
    ``sample.turn_seed()`` when set, so its tokens do not depend on the batch, the step or the order.
    """

    #: the registry name (``rollout.engine``) this class serves under; used in records and errors
    name: ClassVar[str] = ""

    @classmethod
    @abstractmethod
    def capabilities(cls, config: RunConfig, options: Any) -> EngineCapabilities:
        """What this engine supports under ``config`` and ``options`` (``rollout.options`` as the
        kernel validated it against ``Config``; None when the engine declares no options)."""

    @classmethod
    def memory_layout(cls, config: RunConfig, options: Any, facts: ModelFacts) -> MemoryLayout | None:
        """What this engine will hold per device under ``config`` (the memory plan, :mod:`unirl.memory_plan`):
        weights in the serving dtype per worker, KV cache, sync staging. None (this default): undeclared,
        left out of the plan and named as such."""
        return None

    @property
    @abstractmethod
    def weight_version(self) -> int:
        """The version of the weights being served: the last successful :meth:`load_weights`."""

    @property
    @abstractmethod
    def in_flight(self) -> int:
        """Samples submitted and not yet handed back by :meth:`poll` or :meth:`abort`."""

    @abstractmethod
    def submit(self, samples: list[Sample], sampling: SamplingParams) -> Handle:
        """Queue one model turn for each sample; return at once (see ``capabilities().async_submit``)."""

    @abstractmethod
    def poll(self, handle: Handle | None = None, timeout: float = 0.0) -> list[Sample]:
        """Completed samples (of ``handle``, or of any submission), each handed back once.

        Waits up to ``timeout`` seconds for at least one completion; returns ``[]`` if none."""

    @abstractmethod
    def abort(self, handle: Handle | None = None) -> list[Sample]:
        """End the requests of ``handle`` (or all) now; return them with what was generated so far and
        ``finish_reason="abort"``. Afterwards none of them is in flight or returned by :meth:`poll`."""

    @abstractmethod
    def pause(self) -> None:
        """Start no new work until :meth:`resume` (requests already running finish)."""

    @abstractmethod
    def resume(self) -> None:
        """Undo :meth:`pause`."""

    def wait_running(self, timeout: float) -> bool:
        """After :meth:`pause`: wait up to ``timeout`` seconds until no request is running (queued ones stay
        queued); True once none is. Only engines whose capabilities declare ``requests_across_sync:
        queued`` implement it (stream mode's sync: pause, this, load, resume)."""
        raise NotImplementedError(f"rollout.engine {self.name!r} declares requests_across_sync: none")

    def generate(self, samples: list[Sample], sampling: SamplingParams) -> list[Sample]:
        """Blocking form: submit and wait for every sample; returns ``samples`` (filled in place)."""
        handle = self.submit(samples, sampling)
        waiting = set(handle.sample_ids)
        while waiting:
            for s in self.poll(handle, timeout=1.0):
                waiting.discard(s.id)
        return samples

    @abstractmethod
    def stage(self) -> Staged:
        """An empty :class:`unirl.weights.Staged` checked against this engine's weight spec, for one sync."""

    @abstractmethod
    def load_weights(self, staged: Staged, version: int) -> list[Receipt]:
        """Load a complete staged set in place as ``version``; return one receipt per worker.

        Raises :class:`~unirl.kernel.errors.SyncRefusedError` while requests are in flight, and
        :class:`~unirl.kernel.errors.WeightSyncError` for a bad payload; either way the previous
        weights keep serving."""

    def load_adapter(self, path: str, version: int) -> list[Receipt]:
        """Serve the peft LoRA adapter directory ``path`` (``Actor.export_adapter``) on top of this engine's
        base weights as ``version``, replacing the previous adapter; every request submitted afterwards
        uses it. Return one receipt per replica whose fingerprint is :func:`adapter_fingerprint` of the
        adapter tensors it was given. Same refusals as :meth:`load_weights`.

        Why a separate method: ``actor.lora.sync: adapter`` sends r x (in + out) numbers per adapted layer
        instead of the whole model, but only an engine with LoRA support can serve them, which it declares
        with ``capabilities().lora_adapters`` (preflight reads it before anything is built). This default
        is for engines without it."""
        raise ConfigError(f"rollout.engine {self.name!r} cannot serve a LoRA adapter (its capabilities declare no "
                          "lora_adapters): set actor.lora.sync: merged, or use an engine that serves adapters (vllm)")

    def close(self) -> None:  # noqa: B027 - optional
        """Release processes and memory."""


@dataclass
class BackwardContext:
    """What ``unirl_before_backward`` sees for one micro-batch, on the rank that holds it.

    ``logprobs`` are the trainer's fp32 selected-token log-probs (detached), ``rollout_logprobs`` the
    engine's, both the micro-batch's responses concatenated in sample order. ``rl_step`` is the
    trainer step (0-based); ``update`` the optimizer update within it (``updates_per_batch``);
    ``micro_batch`` the index within the update. A padding micro-batch (FSDP ranks run the same
    number of collectives) has no samples and empty tensors.
    """

    rl_step: int
    update: int
    micro_batch: int
    rank: int
    world_size: int
    samples: list[Sample]
    logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor


#: the before-backward callback an actor runs; the trainer builds it from the kernel's hooks
BeforeBackward = Callable[[BackwardContext], None]
#: a context manager factory entered around every replay / training forward and backward (parity)
ExactContext = Callable[[str], AbstractContextManager[Any]]


@dataclass(frozen=True)
class StepInfo:
    """Where a ``train_step`` sits in the run, for hooks: trainer step and update index."""

    rl_step: int = 0
    update: int = 0


class Actor(ABC):
    """The trainer-side model: replay, loss, backward, optimizer, checkpoints.

    Built as ``factory(config=, adapter=, tokenizer=, runtime=unirl.runtime.Runtime, options=Config | None)``:
    the runtime (required) carries what the trainer's kernel resolved (policy loss, hook callbacks,
    worker env), so an actor never builds a kernel of its own; ``options`` is ``actor.options`` as the
    kernel validated it against the class's ``Config`` (None: it declares none).
    """

    @abstractmethod
    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Teacher-forced fp32 log-probs of each sample's response tokens (no grad)."""

    def values(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Per-response-token value estimates (value head); needed by ``gae``."""
        raise NotImplementedError(f"{type(self).__name__} has no value head (set actor.value_head: true)")

    @abstractmethod
    def ref_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Log-probs under the frozen KL reference (:meth:`snapshot_reference`); ``kl_coef > 0`` only."""

    @abstractmethod
    def train_step(self, samples: list[Sample], batch: dict[str, list[torch.Tensor]],
                   info: StepInfo = StepInfo()) -> dict[str, float]:
        """One optimizer step over ``samples`` (all micro-batches, gradient accumulation inside).

        ``batch`` holds per-sample token tensors aligned with the responses: ``advantages``,
        optionally ``old_logprobs``, ``ref_logprobs``, ``returns``, ``old_values``,
        ``rollout_logprobs``, ``token_weights``. Returns scalar metrics (loss, grad_norm, clip_frac,
        kl, entropy, lr). The before-backward callback runs once per micro-batch.

        Without ``old_logprobs``, pi_old is the policy this step's forward runs (one update per batch:
        the weights have not moved since the rollout's replay would have run), so each micro-batch
        uses its own forward's detached log-probs as pi_old, and no separate replay pass is needed
        (:func:`unirl.trainer.replay.old_logprobs_needed` says when that holds). An actor must then
        give bitwise the losses and gradients it gives with ``old_logprobs = self.logprobs(samples)``:
        its replay and its training forward run the same micro-batches with the same numerics.
        """

    @abstractmethod
    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """One supervised step (cross-entropy on the response tokens), with its own optimizer."""

    @abstractmethod
    def snapshot_reference(self) -> None:
        """Freeze the current weights as the KL reference (no-op when ``kl_coef`` is 0)."""

    @abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights in HF names, streamed, for weight sync and export."""

    @abstractmethod
    def save(self, path: str, extra: Mapping[str, Any] | None = None) -> str:
        """Atomic checkpoint at ``path`` (weights, optimizer, scheduler, RNG, the trainer's ``extra``);
        moves ``<parent>/latest`` to it. A crash mid-save keeps the old one. Returns the path."""

    @abstractmethod
    def load(self, path: str) -> dict[str, Any]:
        """Restore what :meth:`save` wrote (``path`` or the one ``path/latest`` names); return ``extra``."""

    @abstractmethod
    def export_hf(self, path: str) -> None:
        """Write an HF directory (config + safetensors + tokenizer) that transformers and vLLM load."""

    def export_adapter(self, path: str) -> None:
        """Write the LoRA adapter alone as a peft directory (``actor.lora``; ``unirl export --adapter``).
        An actor that trains no adapter refuses, which is what this default does."""
        raise ConfigError(f"{type(self).__name__} trains no LoRA adapter (actor.lora is not set, or this actor "
                          "does not support it): export the full model instead (unirl export without --adapter)")

    @abstractmethod
    def set_before_backward(self, callback: BeforeBackward | None) -> None:
        """Install the callback run on every micro-batch after the loss and before ``backward()``."""

    @classmethod
    def memory_layout(cls, config: RunConfig, options: Any, facts: ModelFacts) -> MemoryLayout | None:
        """What this actor will hold per device under ``config`` and its validated ``options`` (the memory
        plan, :mod:`unirl.memory_plan`; :func:`unirl.memory_plan.arithmetic.actor_items` has the shared
        arithmetic), with the fixes it supports. None (this default): undeclared, named as such."""
        return None

    def memory_peaks(self) -> list[MemoryPeak]:
        """Each of the actor's own processes' peak memory since the last call, in rank order, each
        process's mark reset as it answers (:meth:`unirl.memory.PeakMeter.take`); the trainer asks at
        every phase's end (:mod:`unirl.trainer.memory`). An actor that runs in the trainer's process
        has none of its own (this default): the trainer's own meter already covers it, and a second
        reader of the same mark would cut the trainer's phases short."""
        return []

    def close(self) -> None:  # noqa: B027 - optional
        """Release processes and memory. Safe to call twice."""


class WeightSync(ABC):
    """Moves weights from an actor into an engine; the only way a new version is published.

    Built as ``factory(config=RunConfig, options=Config | None)``: ``weight_sync.options`` as the
    kernel validated it against the class's ``Config`` (None: it declares none)."""

    @abstractmethod
    def publish(self, actor: Actor, engine: RolloutEngine, version: int) -> tuple[list[Receipt], str]:
        """Push the actor's weights as ``version``; return the receipts and the sender's fingerprint."""


# ------------------------------------------------------------------------------ registry traits


@dataclass(frozen=True)
class EstimatorTraits:
    """What an advantage estimator needs, declared next to it (``fn.traits``) so preflight and the
    trainer read it instead of checking estimator names.

    * ``needs_groups``: statistics are per GRPO group (siblings must be whole in one call, and a
      sharded actor keeps a group on one rank);
    * ``needs_values``: per-token values from the actor's value head (``actor.value_head: true``);
    * ``min_n``: the smallest ``rollout.n`` it is defined for.

    Its options model (``algorithm.estimator_options``) is the estimator's ``Config``, like every
    component's (:mod:`unirl.kernel.options`).
    """

    needs_groups: bool = False
    needs_values: bool = False
    min_n: int = 1
    #: the values of ``algorithm.group_layer`` it implements (``root``: the samples of one launch;
    #: ``turn``, ``fork``: docs/algorithms.md); preflight refuses any other
    group_layers: tuple[str, ...] = ("root",)


def traits_of(estimator: Any) -> EstimatorTraits:
    """The traits an estimator declares; an estimator without them is a plugin bug, named here."""
    traits = getattr(estimator, "traits", None)
    if not isinstance(traits, EstimatorTraits):
        from unirl.kernel.errors import PluginError

        raise PluginError(f"advantage estimator {getattr(estimator, '__name__', estimator)!r} declares no "
                          "EstimatorTraits (decorate it with unirl.algorithms.advantages.estimator(...))")
    return traits


# ------------------------------------------------------------------------------ seams for plugins


class ParityProvider(ABC):
    """Reference numerics for one model family that make engine and trainer log-probs bit-identical.

    Registered through ``unirl_parity_providers`` under the name a :class:`ModelAdapter` gives in
    ``parity_adapter``. Core calls it at two places and nowhere else:

    * :meth:`exact_context` around every actor forward that produces objective-facing log-probs
      (replay, the training forward and its backward, so activation-checkpoint recompute is inside);
    * :meth:`install_engine` in the process that builds an engine's model, before it is built.
    """

    #: the number of keys the provider's attention reads per chunk. The embedded engine allocates and
    #: serves its KV cache in whole blocks of it, so the provider's attention reads the cache in place
    #: instead of copying it into zero-padded chunks every decode step (correctness never depends on
    #: it: keys past a query's position are masked zeros). 1: no blocking.
    key_block: ClassVar[int] = 1

    def __init__(self, *, config: RunConfig) -> None:
        self.config = config

    @abstractmethod
    def enabled(self) -> bool:
        """Whether parity is on for this run (e.g. ``UNIRL_PARITY_ENABLE=1``)."""

    @abstractmethod
    def exact_context(self, phase: str) -> AbstractContextManager[Any]:
        """Enter the reference ops for ``phase`` ("replay", "train", "reference")."""

    @abstractmethod
    def install_engine(self, engine: str) -> None:
        """Install the engine-side reference ops for ``engine`` ("torch", "vllm", ...)."""


class TraceExporter(ABC):
    """Receives every scored rollout batch (``trace.exporter``); writes a trace at :meth:`close`.

    Built as ``factory(config=RunConfig, options=Config | None)``: ``options`` is ``trace.options`` as
    the kernel validated it against the ``Config`` model the class declares (None: it declares none)."""

    @abstractmethod
    def record(self, *, phase: str, step: int, version: int, samples: list[Sample]) -> None:
        """Called after every train and eval rollout, with the samples' request records."""

    @abstractmethod
    def close(self) -> str | None:
        """Flush; return the path written (or None)."""


class NullTracer(TraceExporter):
    """``trace.exporter`` unset: records nothing. The trainer always holds a tracer, so no call site asks
    whether there is one."""

    def record(self, *, phase: str, step: int, version: int, samples: list[Sample]) -> None:
        pass

    def close(self) -> str | None:
        return None


class Tracker(ABC):
    """An experiment tracker (``logging.trackers``): gets every row ``metrics.jsonl`` gets, the run's
    parameters once, and artifacts (the curves PNG); core's is ``tensorboard``, ``unirl-trackers`` adds
    W&B, MLflow and Trackio.

    Built once per run as ``factory(config=RunConfig, run_dir=Path, params=dict[str, str],
    resume_step=int | None, options=Config | None)``: ``params`` is the flattened run config plus ``git_revision`` and the
    installed UniRL distributions' versions (``version/<dist>``); ``resume_step`` is the first step a
    resumed run logs again (None for a fresh run). ``options`` is ``logging.options[<name>]`` as the
    kernel validated it against the ``Config`` model the class declares (None: it declares none),
    bound here (``self.options``).

    Why the trainer wraps every call: a tracker is an observer. A network error, a full quota or a
    library bug in one is reported once, counted, and never stops training (:mod:`unirl.trainer.trackers`).
    """

    #: the pydantic model of ``logging.options[<name>]`` (None: takes no options)
    Config: ClassVar[type | None] = None

    def __init__(self, *, config: RunConfig, run_dir: Path, params: dict[str, str],
                 resume_step: int | None = None, options: Any = None) -> None:
        self.config, self.run_dir, self.params, self.resume_step = config, run_dir, params, resume_step
        self.options = options

    @abstractmethod
    def log(self, metrics: dict[str, float], step: int) -> None:
        """One step's finite numeric metrics (``step`` is the row's ``step``)."""

    def log_artifact(self, path: Path) -> None:  # noqa: B027 - optional: a tracker may keep no files
        """A file the run wrote (the curves PNG at the end); default: not kept."""

    @abstractmethod
    def close(self) -> None:
        """Flush and finish the tracker's run."""


class BatchReward(ABC):
    """A reward that scores a whole rollout batch in one call (``reward.name``), registered through
    ``unirl_rewards`` beside the per-sample functions ``fn(completion, sample) -> float``.

    Why a class of its own: a model-based reward (an LLM judge served by an engine, a reward model)
    must batch its model calls across the rollout batch and hold a model for the run, which a
    per-sample function cannot. Built once per run as ``factory(config=RunConfig, kernel=Kernel)``
    (after preflight, so it may load models) and closed at the end of the run.
    """

    #: the ``reward.*`` sub-sections it reads (e.g. ``("judge",)``): preflight flags a sub-section that
    #: is set while the selected reward does not read it (a misconfigured run, not a silent default)
    reads: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def check(cls, config: RunConfig, kernel: Any) -> list[Any]:
        """Preflight: the :class:`~unirl.kernel.errors.Violation` s of ``config`` for this reward (that
        its model loads, its template has its fields ...), cheap, before any model is built."""
        return []

    @abstractmethod
    def score_batch(self, completions: list[str], samples: list[Sample]) -> list[float]:
        """One reward per sample, aligned with ``samples``. NaN marks that sample *failed* (judge error or
        timeout; say why in ``sample.meta["reward_error"]``): it leaves its group's statistics, it is
        never a miss. Named parts of a reward (a composition's terms) go to
        ``sample.meta["reward_terms"]`` (``{name: value}``), which the trainer logs as ``reward/<name>``.
        Raising fails the whole batch."""

    def __call__(self, completion: str, sample: Sample) -> float:
        """The per-sample form (a rollout controller that scores one trajectory at a time)."""
        return self.score_batch([completion], [sample])[0]

    def close(self) -> None:  # noqa: B027 - optional
        """Release the models and engines it holds. Safe to call twice."""


@dataclass
class ToolResult:
    """What a tool call returns to the model, as text; ``error`` marks a failed call (still observed)."""

    content: str
    error: bool = False


class Tool(ABC):
    """A tool an agent may call (``rollout.tools``). Built as ``factory(config=RunConfig)``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""

    @abstractmethod
    def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Run the tool on validated JSON ``arguments``; never raise for bad input, return an error."""


@dataclass
class EnvStep:
    """An environment's answer to one model turn: text to append as an observation (may be empty),
    whether the trajectory is over, and the reward when it is."""

    observation: str = ""
    done: bool = False
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """A multi-turn environment (``rollout.environment``), re-entrant across concurrent trajectories.

    Built as ``factory(config=RunConfig, tools=dict[str, Tool], tokenizer=...)``; state per trajectory
    is keyed by ``sample.id``. ``close(sample)`` always runs: on success, crash and abort."""

    #: whether a trajectory holds state outside its tokens (e.g. a tool session): such a trajectory
    #: cannot be resumed after a weight sync by replaying its tokens, so a controller drops it instead
    stateful: bool = False
    #: stop strings a model turn needs (e.g. ``"</tool_call>"``, so a turn ends right after a call); the
    #: rollout controller adds them to the sampling params
    stop: tuple[str, ...] = ()

    @abstractmethod
    def reset(self, sample: Sample) -> None:
        """Start a trajectory for ``sample``. A sample that already has turns is being resumed (a carried
        tail restored from a checkpoint): a stateless environment derives its state from the sample."""

    @abstractmethod
    def step(self, sample: Sample, turn_text: str) -> EnvStep:
        """React to the model's latest turn."""

    @abstractmethod
    def close(self, sample: Sample) -> None:
        """Release what ``reset`` took for ``sample``."""


class RolloutController(ABC):
    """How a step's groups are generated (``rollout.controller``): ``batch``, core's default, is one
    ``engine.generate`` per collect; a plugin's drives multi-turn environments or partial rollout. The
    trainer keeps the policy: it calls :meth:`collect` once per step (DAPO: once per refill round) and
    per eval, syncs weights after it returns (async: on a background thread, one collect ahead), and
    calls :meth:`close` at the end of the run. Built as documented on ``unirl_rollout_controllers``."""

    #: it implements ``rollout.branching`` (forks trajectories at given turns; then a collect returns
    #: more than ``groups * n`` samples: each fork's branches replace the trajectory that forked);
    #: preflight refuses ``rollout.branching`` for a controller that does not
    supports_branching: ClassVar[bool] = False
    #: :meth:`collect` may run on several threads at once (``rollout.mode: stream`` launches one group per
    #: call, concurrently); preflight refuses stream mode for a controller that does not declare it
    concurrent_collects: ClassVar[bool] = False

    @abstractmethod
    def collect(self, draw: Callable[[int], list[Sample]], *, groups: int, n: int,
                sampling: SamplingParams, launch_tag: str) -> list[Sample]:
        """``groups`` whole groups of ``n`` scored, validated samples (fewer only when ``draw(k)``, which
        returns up to ``k`` fresh prompts, runs dry). When it returns nothing is in flight on the engine,
        so the trainer may sync weights; failed samples (reward NaN) stay in their group.

        ``launch_tag`` is unique within the run: ``train-{step}`` (a DAPO refill round:
        ``train-{step}.{k}``) or ``eval-{step}``. A controller that launches each drawn prompt once may
        use it as the :func:`unirl.samples.expand` tag, so sample ids and seeds follow the step (a resumed
        run samples what the uninterrupted one did); one that keeps its own counter may ignore it."""

    @abstractmethod
    def metrics(self) -> dict[str, float]:
        """Metrics of the last :meth:`collect`, logged with the step (names prefixed by the plugin)."""

    @abstractmethod
    def warm_start_samples(self, prompts: list[Sample]) -> list[Sample]:
        """SFT warm-start traces for ``prompts`` in this controller's trajectory format (e.g. a tool call,
        the tool's turn with loss mask 0, the answer): the trainer's ``sft.steps`` train on these."""

    @abstractmethod
    def close(self) -> None:
        """Abort what is in flight and release every trajectory; idempotent."""

    def state_dict(self) -> dict[str, Any]:
        """What the controller carries from one :meth:`collect` to the next (e.g. a partial rollout's
        tail), saved with every checkpoint (pickled, after :meth:`collect` returned); ``{}`` when it
        carries nothing. Raise, naming the fix, when the carried state cannot be saved soundly."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into a fresh controller on resume, before its first :meth:`collect`."""
        if state:
            raise NotImplementedError(f"{type(self).__name__} saved carried state but cannot restore it")
