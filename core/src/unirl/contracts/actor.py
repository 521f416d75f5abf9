"""The trainer-side actor contract and what its hooks see (backward context, step info)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from unirl.contracts.capabilities import ActorCapabilities
from unirl.kernel.errors import ConfigError
from unirl.memory import MemoryPeak
from unirl.samples import Sample

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.config import RunConfig
    from unirl.memory_plan.layout import MemoryLayout, ModelFacts


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

    #: whether :meth:`hold_version` and :meth:`logprobs_at` work: declared by the class, read by the
    #: mismatch diagnostics (without it, tokens of older versions are counted as unheld, not replayed)
    keeps_versions: ClassVar[bool] = False

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

    def frozen_weights(self) -> dict[str, tuple[int, ...]]:
        """The weights this actor never changes, as :meth:`named_weights` names them, with their full
        shapes: parts frozen when it was built (``actor.freeze``), which get no gradient and no update.
        A weight sync leaves them out once the engine holds them (:mod:`unirl.sync.held`); an actor must
        therefore list only weights whose streamed value cannot move after its first publish. This
        default: none (every weight may change)."""
        return {}

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

    def hold_version(self, version: int, keep: Collection[int]) -> None:
        """Keep a copy of the current trainable weights as weight version ``version`` (off the accelerator,
        on the CPU; a sharded actor keeps each rank's own shards), and drop every held version not in
        ``keep``. The trainer calls it at each publish in async / stream modes, so the mismatch diagnostics
        can replay a batch at the weights that sampled it (:mod:`unirl.mismatch`, docs/mismatch.md).
        An actor that cannot declares ``keeps_versions`` False and refuses, which is what this default does."""
        raise ConfigError(f"{type(self).__name__} cannot keep older weight versions, which the staleness term "
                          "of the mismatch diagnostics replays against: set diagnostics.mismatch_every: 0")

    def logprobs_at(self, version: int, samples: list[Sample]) -> list[torch.Tensor]:
        """:meth:`logprobs` under the weights held as ``version`` (:meth:`hold_version`), the same
        micro-batches and numerics; the current weights are back in place when it returns."""
        raise ConfigError(f"{type(self).__name__} cannot replay at an older weight version: set "
                          "diagnostics.mismatch_every: 0")

    @abstractmethod
    def set_before_backward(self, callback: BeforeBackward | None) -> None:
        """Install the callback run on every micro-batch after the loss and before ``backward()``."""

    @classmethod
    def capabilities(cls, config: RunConfig, options: Any) -> ActorCapabilities:
        """The layout this actor will run with under ``config`` and its validated ``options`` (ranks,
        compute dtype, compiled), resolved once by core into the ``Runtime`` and handed to every plugin's
        ``unirl_preflight``. This default: one rank computing in ``model.dtype``, nothing compiled."""
        return ActorCapabilities()

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
