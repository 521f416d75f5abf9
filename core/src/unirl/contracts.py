"""The contracts every engine, actor, weight-sync transport and model adapter serves.

Several implementations exist for each (embedded torch, vLLM, SGLang; embedded actor, FSDP), so each
contract is written once here as an abstract class, with the *why* of every method. Types only: no
torch import at module load (tensors appear in annotations as strings).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from unirl.samples import Sample

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.config import RunConfig


@dataclass(frozen=True)
class SamplingParams:
    """What an engine needs to sample; built from ``rollout.*`` by the trainer."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = True  # return the sampled tokens' fp32 log-probs

    @classmethod
    def from_config(cls, config: RunConfig, stop_token_ids: Iterable[int] = (), **changes: Any) -> SamplingParams:
        r = config.rollout
        base = dict(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                    top_k=r.top_k, stop_token_ids=tuple(stop_token_ids))
        base.update(changes)
        return cls(**base)


@dataclass(frozen=True)
class Receipt:
    """One engine worker's answer to a weight sync: what it loaded, fingerprinted."""

    worker: int
    version: int
    fingerprint: str
    num_tensors: int = 0
    seconds: float = 0.0


@dataclass
class VersionLedger:
    """The policy version the engines serve. Only a committed sync advances it."""

    version: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)

    def commit(self, version: int, receipts: list[Receipt], manifest_fingerprint: str) -> None:
        bad = [r for r in receipts if r.fingerprint != manifest_fingerprint or r.version != version]
        if not receipts or bad:
            raise RuntimeError(
                f"weight sync to version {version} not committed: "
                + (f"{len(bad)} of {len(receipts)} receipts disagree with the sender's manifest "
                   f"({manifest_fingerprint[:12]}): {bad}" if receipts else "no receipts")
            )
        self.version = version
        self.history.append({"version": version, "fingerprint": manifest_fingerprint,
                             "workers": [r.worker for r in receipts]})


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


class ModelAdapter(ABC):
    """How to build, tokenize and rename one model family. Third-party models ship one of these.

    The default ``qwen3`` adapter lives in :mod:`unirl.models.qwen3`.
    """

    name: str = ""
    parity_adapter: str | None = None  # name of the parity provider that applies, if any

    @abstractmethod
    def build_model(self, config: RunConfig, tokenizer: Any = None) -> torch.nn.Module:
        """A transformers causal LM, from ``model.path`` or from scratch (``model.build``, sized to
        ``tokenizer``'s vocabulary). Same config + seed gives the same weights."""

    @abstractmethod
    def build_tokenizer(self, config: RunConfig) -> Any:
        """A ``transformers.PreTrainedTokenizerFast`` (pad, eos set)."""

    def engine_weight_name(self, name: str, engine: str) -> str:
        """Map an actor parameter name to what ``engine`` expects (identity for HF-format engines)."""
        return name

    def engine_args(self, engine: str, config: RunConfig) -> dict[str, Any]:
        """Extra engine constructor arguments this model needs (e.g. vLLM's ``max_model_len``)."""
        return {}


class RolloutEngine(ABC):
    """Generates completions for sample slots. Loops the engine dictates (batching, KV cache) live here."""

    #: the policy version whose weights this engine holds; stamped on every generated token
    weight_version: int = 0

    @abstractmethod
    def generate(self, samples: list[Sample], sampling: SamplingParams) -> list[Sample]:
        """Fill one completion into each sample slot and return the same samples, in order.

        Sets ``response_ids``, ``loss_mask`` (all 1), ``rollout_logprobs`` (fp32 log-probs of the
        sampled tokens under the *raw* model distribution, ``log_softmax(logits)`` before temperature,
        top-p or top-k: what the actor's replay computes, and vLLM's ``raw_logprobs``), ``versions``
        (``weight_version``), ``finish_reason`` ("stop" / "length") and ``status`` ("ok" /
        "truncated"). Honors ``sample.seed`` when set, so a sample's completion does not depend on its batch.
        """

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> list[Receipt]:
        """Replace the served weights in place and return one receipt per worker.

        Must refuse while a generation is in flight, and must leave the previous weights serving when
        it fails.
        """

    def close(self) -> None:  # noqa: B027 - optional
        """Release processes and memory."""


class Actor(ABC):
    """The trainer-side model: replay, loss, backward, optimizer, checkpoints."""

    @abstractmethod
    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Teacher-forced fp32 log-probs of each sample's response tokens (no grad)."""

    def values(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Per-response-token value estimates (value head); needed by ``gae``."""
        raise NotImplementedError(f"{type(self).__name__} has no value head (set actor.value_head: true)")

    @abstractmethod
    def train_step(self, samples: list[Sample], batch: dict[str, list[torch.Tensor]]) -> dict[str, float]:
        """One optimizer step over ``samples`` (all micro-batches, gradient accumulation inside).

        ``batch`` holds per-sample token tensors aligned with the responses: ``advantages``,
        ``old_logprobs``, optionally ``ref_logprobs``, ``returns``, ``old_values``,
        ``rollout_logprobs``. Returns scalar metrics (loss, grad_norm, clip_frac, kl, entropy, lr).
        """

    @abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights in HF names, streamed, for weight sync and export."""

    @abstractmethod
    def save(self, path: str) -> None:
        """Atomic checkpoint: weights, optimizer, scheduler, RNG. A crash mid-save keeps the old one."""

    @abstractmethod
    def load(self, path: str) -> None:
        """Restore what :meth:`save` wrote."""

    @abstractmethod
    def export_hf(self, path: str) -> None:
        """Write an HF directory (config + safetensors) that transformers and vLLM load."""


class WeightSync(ABC):
    """Moves weights from an actor into an engine; the only way a new version is published."""

    @abstractmethod
    def publish(self, actor: Actor, engine: RolloutEngine, version: int) -> tuple[list[Receipt], str]:
        """Push the actor's weights as ``version``; return the receipts and the sender's fingerprint."""
