"""The embedded actor: one process, fp32 master weights, AdamW, packed micro-batches.

Everything it shares with the FSDP actor (the per-micro-batch math, the replay and train loops,
clip-and-step, SFT, HF names and export) is :mod:`unirl.actor.skeleton`; the names below are
re-exported from there for callers that import them from this module. This class adds only what one
process owns: the model on one device, a deep-copied KL reference, single-file checkpoints
(:mod:`unirl.actor.checkpoint`). With ``actor.lora`` the model is a peft model (:mod:`unirl.actor.lora`):
only the adapter trains, weight sync and the HF export get merged weights, checkpoints hold the adapter.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from unirl.actor import lora, regional_compile
from unirl.actor.checkpoint import checkpoint_states, load_checkpoint, save_checkpoint
from unirl.actor.declaration import TorchActorDeclaration, TorchActorOptions  # noqa: F401 - re-exported
from unirl.actor.freeze import freeze_parts
from unirl.actor.skeleton import (  # noqa: F401 - re-exported
    ActorInputError,
    ActorSkeleton,
    build_optimizer,
    build_scheduler,
    check_samples,
    forward_logprobs,
    hf_named_weights,
    lr_factor,
    micro_batch_loss,
    reduce_metrics,
    sft_micro_batch_loss,
    step_denominators,
    step_metrics,
    train_params,
    write_hf_dir,
)
from unirl.actor.vision_inputs import install_actor_hooks
from unirl.config import RunConfig
from unirl.contracts import BeforeBackward, ModelAdapter, StepInfo
from unirl.kernel.errors import ConfigError
from unirl.packing import pack
from unirl.samples import Sample

if TYPE_CHECKING:  # pragma: no cover
    from unirl.runtime import Runtime


class TorchActor(ActorSkeleton, TorchActorDeclaration):
    """Single-process actor (CPU or one GPU). See :mod:`unirl.actor.skeleton` for the shared pieces.

    ``runtime`` is the trainer's (:class:`unirl.runtime.Runtime`), always passed: an actor never builds
    a kernel of its own (tests build one with :func:`unirl.testing.default_runtime`). ``options`` is
    ``actor.options`` as the kernel validated it (:class:`TorchActorOptions`; None: the defaults)."""

    # Config, capabilities and memory_layout: its declaration (unirl.actor.declaration), which the plan reads
    # without importing this module

    def __init__(
        self,
        *,
        config: RunConfig,
        adapter: ModelAdapter,
        runtime: Runtime,
        tokenizer: Any = None,
        model: torch.nn.Module | None = None,
        device: str | torch.device | None = None,
        options: TorchActorOptions | None = None,
    ) -> None:
        self._init_skeleton(config, runtime)
        self.options = options or TorchActorOptions()
        if self.options.compile and config.actor.lora is not None:  # before the model is built
            raise ConfigError("actor.options.compile: not with actor.lora (the adapter's layers are neither "
                              "compiled nor tested compiled); leave actor.options.compile unset")
        self.adapter = adapter
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if model is None:
            if tokenizer is None:
                self.tokenizer = tokenizer = adapter.build_tokenizer(config)
            model = adapter.build_model(config, tokenizer)
        self.model = self._prepare_model(model, device=self.device)
        # actor.freeze: before the optimizer sees the params
        self._frozen = {n: tuple(self.model.get_parameter(n).shape)
                        for n in freeze_parts(self.model, adapter, config.actor.freeze)}
        if adapter.vision:  # packed text-only batches keep their sequences apart (vision_inputs)
            install_actor_hooks(self.model, sharded=False)
        self._lora_base: str | None = None
        if config.actor.lora is not None:
            # seeded from run.seed: the same adapter init as the FSDP actor's ranks, and a rerun's
            self.model = lora.apply_lora(self.model, config.actor.lora, base_path=config.model.path,
                                         seed=config.run.seed)
            self._lora_base = lora.base_fingerprint(self.model)
        self._setup_training()
        #: the seconds the compile warm-up took, reported once (the first RL step's ``compile_s``)
        self._compile_s: float | None = self._compile() if self.options.compile else None

    def _compile(self) -> float:
        """``actor.options.compile``: the regions marked and compiled now, by a warm-up through the
        actor's own forward (packing, checkpointing, the compute dtype) on a two-sample batch."""
        regional_compile.compile_regions(self.model)
        vocab = self.model.config.vocab_size
        warm = [Sample(id=f"compile-warm-up/{i}", prompt_ids=[(7 * i + j) % vocab for j in range(5 + i)],
                       response_ids=[(3 * i + j) % vocab for j in range(4 + 2 * i)]) for i in range(2)]
        packed = pack(warm)

        def step(grad: bool) -> None:
            with self._compute():
                logp, _, _ = forward_logprobs(self.model, packed)
            if grad:
                logp.float().sum().backward()

        return regional_compile.warm_up(self.model, step)

    def set_before_backward(self, callback: BeforeBackward | None) -> None:
        self.before_backward = callback

    def _compute(self) -> contextlib.AbstractContextManager[Any]:
        if self.options.compute_dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -------------------------------------------------------------------- reference
    def snapshot_reference(self) -> None:
        """Freeze a copy of the current weights as the KL reference (only when ``kl_coef > 0``)."""
        if self.config.algorithm.kl_coef <= 0:
            self.reference = None
            return
        self.reference = self._new_reference()
        self.reference.load_state_dict(self.model.state_dict())

    def _new_reference(self) -> torch.nn.Module:
        ref = copy.deepcopy(self.model)
        ref.eval()
        ref.requires_grad_(False)
        return ref

    # -------------------------------------------------------------------- replay
    def logprobs(self, samples: list[Sample]) -> list[Tensor]:
        return self._replay(self.model, samples, phase="replay")

    def logprobs_at(self, version: int, samples: list[Sample]) -> list[Tensor]:
        return self._replay_at(version, samples)

    def values(self, samples: list[Sample]) -> list[Tensor]:
        if self.value_head is None:
            return super().values(samples)
        return self._replay(self.model, samples, phase="replay", values=True)

    def ref_logprobs(self, samples: list[Sample]) -> list[Tensor]:
        if self.reference is None:
            raise RuntimeError("no reference policy (algorithm.kl_coef is 0, or snapshot_reference not called)")
        return self._replay(self.reference, samples, phase="reference")

    # -------------------------------------------------------------------- updates
    def train_step(self, samples: list[Sample], batch: dict[str, list[Tensor]],
                   info: StepInfo = StepInfo()) -> dict[str, float]:
        check_samples(samples, "train_step")
        total_tokens, total_seqs = step_denominators(samples)
        out = self._train_update(self._micro_batches(samples, batch), info, total_tokens=total_tokens,
                                 total_seqs=total_seqs)
        metrics = step_metrics([out], self.runtime.metric_reduce, tokens=total_tokens)
        if self._compile_s is not None:  # once: the warm-up's compiling, apart from the step's own time
            metrics["compile_s"], self._compile_s = self._compile_s, None
        return metrics

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """One supervised step: cross-entropy on the response tokens, own AdamW at ``sft.lr``."""
        check_samples(samples, "sft_step")
        total_tokens, _ = step_denominators(samples)
        out = self._sft_update(self._micro_batches(samples), total_tokens=total_tokens)
        return step_metrics([out], self.runtime.metric_reduce, tokens=total_tokens)

    # -------------------------------------------------------------------- weights out
    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """HF-named weights; with ``actor.lora`` the merged ones (base + adapter), so any engine loads them."""
        if self._lora_base is not None:
            return lora.merged_named_weights(self.model, hf_named_weights)
        return hf_named_weights(self.model)

    def frozen_weights(self) -> dict[str, tuple[int, ...]]:
        """The ``actor.freeze`` parts (never updated, so a sync sends them once). None under ``actor.lora``:
        the merged weights it streams are the ones an adapter may touch."""
        return {} if self._lora_base is not None else dict(self._frozen)

    def export_hf(self, path: str) -> None:
        """``save_pretrained`` (safetensors, fp32, tied weights once) + tokenizer, atomically; with
        ``actor.lora`` the merged model, in the base model's class and names."""
        if self._lora_base is not None:
            write_hf_dir(path, self.model.get_base_model(), self.tokenizer, state_dict=dict(self.named_weights()))
            return
        write_hf_dir(path, self.model, self.tokenizer)

    def export_adapter(self, path: str) -> None:
        """The LoRA adapter alone as a peft directory (``PeftModel.from_pretrained(base, path)`` loads it)."""
        if self._lora_base is None:
            super().export_adapter(path)
        lora.write_adapter_dir(path, self.model, self.tokenizer)

    # -------------------------------------------------------------------- checkpoints
    def save(self, path: str, extra: Mapping[str, Any] | None = None) -> str:
        """Atomic checkpoint at ``path`` (see :mod:`unirl.actor.checkpoint`); ``extra`` is the trainer's."""
        stateful = {"sft_optimizer": self._sft_optimizer} if self._sft_optimizer is not None else {}
        dest = save_checkpoint(
            path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            value_head=self.value_head, reference=self.reference, stateful=stateful,
            extra={"actor": {"step": self.step, "lora_base": self._lora_base}, "trainer": dict(extra or {})},
            adapter_only=self._lora_base is not None,
        )
        return str(dest)

    def load(self, path: str) -> dict[str, Any]:
        """Restore a checkpoint (or the one ``path/latest`` names); return the trainer's ``extra``."""
        held = checkpoint_states(path)
        if "reference" in held and self.reference is None and self.config.algorithm.kl_coef > 0:
            self.reference = self._new_reference()
        stateful = {"sft_optimizer": (lambda: self.sft_optimizer)} if "sft_optimizer" in held else {}
        extra = load_checkpoint(
            path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            value_head=self.value_head, reference=self.reference, stateful=stateful,
            adapter_only=self._lora_base is not None,
        )
        base = extra.get("actor", {}).get("lora_base")
        if self._lora_base is not None:
            lora.check_base(str(path), base, self._lora_base)
        self.step = int(extra.get("actor", {}).get("step", 0))
        return dict(extra.get("trainer", {}))
