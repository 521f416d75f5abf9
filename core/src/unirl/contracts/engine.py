"""The rollout engine contract: submit / poll / abort, pause / resume, and weight loads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from unirl.kernel.errors import ConfigError
from unirl.samples import Sample

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import RunConfig
    from unirl.contracts.capabilities import EngineCapabilities
    from unirl.contracts.sampling import SamplingParams
    from unirl.contracts.weight_sync import Receipt
    from unirl.memory_plan.layout import MemoryLayout, ModelFacts
    from unirl.weights import Staged


@dataclass(frozen=True)
class Handle:
    """One ``submit``: its id and the ids of its samples (what ``poll(handle)`` waits for)."""

    id: int
    sample_ids: tuple[str, ...]


@dataclass(frozen=True)
class EngineProgress:
    """What :meth:`RolloutEngine.progress` reports: ``last_at``, the ``time.monotonic()`` of the engine's
    last progress (a decode step, a finished request), ``requests``, the ids of the samples it holds, and
    ``busy_s``, the request-seconds it has spent decoding so far (cumulative; -1: unknown). The stall
    timeout (``rollout.stall_timeout_s``, :mod:`unirl.rollout.stall`) reads it in every mode; stream mode's
    ``stream/decoding`` metric reads ``busy_s`` (a request held is not one decoding: queued ones wait)."""

    last_at: float
    requests: tuple[str, ...] = ()
    busy_s: float = -1.0


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

    def progress(self) -> EngineProgress | None:
        """When this engine last made progress and what it holds (:class:`EngineProgress`), so a hung
        engine is told from a long generation (``rollout.stall_timeout_s``). None (this default): it
        cannot tell, and only a returned launch counts as progress. Called from other threads."""
        return None

    def wait_running(self, timeout: float) -> bool:
        """After :meth:`pause`: wait up to ``timeout`` seconds until no request is running (queued ones stay
        queued); True once none is. Only engines whose capabilities declare ``requests_across_sync:
        queued`` implement it (stream mode's sync: pause, this, load, resume)."""
        raise NotImplementedError(f"rollout.engine {self.name!r} declares requests_across_sync: none")

    def restart_running(self) -> list[str]:
        """After :meth:`pause` (``rollout.stream.on_sync: abort``): stop the running requests, drop what they
        generated and queue them again, first, so they start over under the weights loaded next; returns
        their ids. Engines that declare ``requests_across_sync: queued`` implement it (QueuedEngine does)."""
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
