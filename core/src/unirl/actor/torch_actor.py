"""The embedded actor: one process, fp32 master weights, AdamW, packed micro-batches.

The per-micro-batch math lives in module-level functions so that other actors (the multi-rank FSDP
plugin) reuse it unchanged and only own the distribution around it:

* :func:`forward_logprobs` - one packed forward -> per-response-token fp32 log-probs (+ entropy, values)
* :func:`micro_batch_loss` - PPO loss (+ value loss) of one micro-batch, sum-form with global denominators
* :func:`sft_micro_batch_loss` - supervised cross-entropy of one micro-batch, sum-form
* :func:`step_denominators` - ``(total_tokens, total_seqs)`` of a whole optimizer-step batch
* :func:`reduce_metrics` - combine micro-batch metrics (sum / max per ``losses.METRIC_REDUCE``)
* :func:`build_optimizer`, :func:`build_scheduler` - AdamW and the warmup + decay LR schedule
* :func:`hf_named_weights` - the model's weights in the names ``save_pretrained`` writes

Because every micro-batch loss is divided by denominators computed once over the whole step, summing
the micro-batch gradients gives exactly the full-batch gradient: ``actor.micro_batch_size`` changes
memory, not the update (``tests/test_torch_actor.py`` checks 1 vs 4 vs all to 1e-6). An FSDP actor
computes the denominators over all ranks (all-reduce SUM) and must undo DDP/FSDP gradient averaging.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from unirl.actor.checkpoint import checkpoint_states, load_checkpoint, save_checkpoint
from unirl.algorithms.losses import METRIC_REDUCE, LossInputs, entropy_from_logits, ppo_clip, value_loss
from unirl.config import RunConfig
from unirl.contracts import Actor, ModelAdapter
from unirl.packing import PackedBatch, flatten, pack
from unirl.samples import Sample, chunks

BeforeBackward = Callable[[list[Sample], Tensor], None]

# ------------------------------------------------------------------------------------ reusable math


def forward_logprobs(
    model: torch.nn.Module,
    packed: PackedBatch,
    *,
    with_entropy: bool = False,
    value_head: torch.nn.Module | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One packed forward. Returns ``(logp [N], entropy [N] | None, values [N] | None)`` in fp32.

    ``logp`` is ``log_softmax(logits)`` of each response token under the raw model distribution (no
    temperature), differentiable when grad is enabled. Only the ``N`` target positions' logits are
    computed (``logits_to_keep=target_index``). ``entropy`` is a detached metric. ``values`` come from
    ``value_head`` applied to the final (normed) hidden state at the same positions, i.e. the input of the
    output embedding, captured with a forward pre-hook (works with any HF causal LM and under FSDP).
    """
    if packed.num_tokens == 0:
        empty = torch.zeros(0, device=packed.input_ids.device)
        return empty, (empty if with_entropy else None), (empty if value_head is not None else None)
    captured: dict[str, Tensor] = {}
    handle = None
    if value_head is not None:
        head = model.get_output_embeddings()
        handle = head.register_forward_pre_hook(lambda _m, args: captured.__setitem__("h", args[0]))
    try:
        out = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            use_cache=False,
            logits_to_keep=packed.target_index,
        )
    finally:
        if handle is not None:
            handle.remove()
    logits = out.logits[0].float()  # [N, V]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, packed.target_ids[:, None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())
    values = None
    if value_head is not None:
        hidden = captured["h"][0]  # [N, H]
        values = value_head(hidden.float()).squeeze(-1).float()
    return logp, entropy, values


def step_denominators(samples: Sequence[Sample]) -> tuple[float, float]:
    """``(total_tokens, total_seqs)`` of one optimizer step: masked-in response tokens, and sequences
    with at least one of them (failed / fully masked sequences do not dilute the mean)."""
    tokens = 0.0
    seqs = 0.0
    for s in samples:
        n = sum(1 for x in (s.loss_mask or [1] * len(s.response_ids)) if x)
        tokens += n
        seqs += 1.0 if n else 0.0
    return tokens, seqs


def _flat(batch: Mapping[str, Sequence[Tensor] | None], key: str, packed: PackedBatch,
          device: torch.device) -> Tensor | None:
    vals = batch.get(key)
    if vals is None:
        return None
    return flatten(vals, packed, key).to(device)


@functools.cache
def policy_loss(name: str) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """The policy loss ``algorithm.loss`` names, from the kernel's registry (resolved once per process,
    so the FSDP ranks resolve it the same way). A loss is called exactly like
    :func:`unirl.algorithms.losses.ppo_clip`."""
    if name == "ppo_clip":  # the built-in: no plugin discovery needed in every worker
        return ppo_clip
    from unirl.kernel import load_kernel

    return load_kernel().get("policy_losses", name).load()


def micro_batch_loss(
    model: torch.nn.Module,
    micro_samples: Sequence[Sample],
    batch_tensors: Mapping[str, Sequence[Tensor] | None],
    *,
    config: RunConfig,
    total_tokens: float,
    total_seqs: float,
    value_head: torch.nn.Module | None = None,
    reference: torch.nn.Module | None = None,
    before_backward: BeforeBackward | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip loss (+ ``value_coef`` * value loss) of one micro-batch, sum-form with the step's
    global denominators: call ``backward()`` on it as is and sum over micro-batches.

    ``batch_tensors`` holds this micro-batch's per-sample 1-D tensors: ``advantages``, ``old_logprobs``
    (required), ``ref_logprobs`` (else computed with ``reference`` when ``kl_coef > 0``),
    ``token_weights``, and with a value head ``returns`` + ``old_values``. Metrics are detached 0-d
    tensors in sum form (see :func:`reduce_metrics`), including ``entropy`` (mean over masked tokens).
    ``before_backward(micro_samples, logp)`` is called last (the kernel's ``unirl_before_backward``
    parity gate; it may raise to stop the step) with the detached fp32 log-probs ``[N]``: the
    micro-batch's responses concatenated in sample order, aligned with their ``rollout_logprobs``.
    """
    alg = config.algorithm
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    packed = pack(micro_samples).to(device)
    logp, entropy, values = forward_logprobs(model, packed, with_entropy=True, value_head=value_head)
    old = _flat(batch_tensors, "old_logprobs", packed, device)
    adv = _flat(batch_tensors, "advantages", packed, device)
    if old is None or adv is None:
        raise ValueError("train_step needs batch['old_logprobs'] and batch['advantages']")
    ref = _flat(batch_tensors, "ref_logprobs", packed, device)
    if ref is None and alg.kl_coef > 0:
        if reference is None:
            raise ValueError("algorithm.kl_coef > 0 needs batch['ref_logprobs'] or a reference model")
        with torch.no_grad():
            ref, _, _ = forward_logprobs(reference, packed)
    inp = LossInputs(logprobs=logp, old_logprobs=old, advantages=adv, mask=packed.mask,
                     seq_index=packed.seq_index, seq_lens=packed.seq_lens)
    loss, metrics = policy_loss(alg.loss)(
        inp,
        clip_low=alg.clip_low,
        clip_high=alg.clip_high,
        agg=alg.loss_agg,
        total_tokens=total_tokens,
        total_seqs=total_seqs,
        norm_len=config.rollout.max_new_tokens,
        ref_logprobs=ref,
        kl_coef=alg.kl_coef,
        kl_estimator=alg.kl_estimator,
        token_weights=_flat(batch_tensors, "token_weights", packed, device),
    )
    metrics = dict(metrics)
    if value_head is not None:
        returns = _flat(batch_tensors, "returns", packed, device)
        old_values = _flat(batch_tensors, "old_values", packed, device)
        if returns is None or old_values is None:
            raise ValueError("a value head needs batch['returns'] and batch['old_values']")
        vloss, vmetrics = value_loss(values, old_values, returns, packed.mask, clip=alg.value_clip,
                                     total_tokens=total_tokens)
        loss = loss + alg.value_coef * vloss
        metrics.update(vmetrics)
    tok = total_tokens if total_tokens > 0 else 1.0
    metrics["entropy"] = (entropy * packed.mask).sum() / tok
    metrics["loss"] = loss.detach()
    if before_backward is not None:
        before_backward(list(micro_samples), logp.detach())
    return loss, metrics


def sft_micro_batch_loss(
    model: torch.nn.Module, micro_samples: Sequence[Sample], *, total_tokens: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-mean cross-entropy on the response tokens (``loss_mask``), sum-form over ``total_tokens``."""
    device = next(model.parameters()).device
    packed = pack(micro_samples).to(device)
    logp, entropy, _ = forward_logprobs(model, packed, with_entropy=True)
    tok = total_tokens if total_tokens > 0 else 1.0
    loss = -(logp * packed.mask).sum() / tok
    return loss, {"sft_loss": loss.detach(), "entropy": (entropy * packed.mask).sum() / tok}


def reduce_metrics(parts: Sequence[Mapping[str, Tensor]]) -> dict[str, float]:
    """Combine micro-batch metrics: summed (already divided by global denominators) except the keys
    ``losses.METRIC_REDUCE`` marks "max". An FSDP actor all-reduces the same way over ranks."""
    out: dict[str, float] = {}
    for m in parts:
        for k, v in m.items():
            x = float(v)
            if METRIC_REDUCE.get(k, "sum") == "max":
                out[k] = max(out.get(k, -math.inf), x)
            else:
                out[k] = out.get(k, 0.0) + x
    return out


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the base LR at optimizer step ``step`` (0-based): linear warmup over
    ``warmup_steps``, then constant / linear / cosine decay towards 0 at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_schedule {schedule!r}")


def train_params(model: torch.nn.Module, value_head: torch.nn.Module | None) -> list[torch.nn.Parameter]:
    """What the RL optimizer steps: the policy, plus the value head when there is one."""
    params = list(model.parameters())
    if value_head is not None:
        params += list(value_head.parameters())
    return params


def build_optimizer(params: Sequence[torch.nn.Parameter], config: RunConfig, lr: float | None = None):
    a = config.actor
    return torch.optim.AdamW(list(params), lr=a.lr if lr is None else lr, betas=tuple(a.betas),
                             weight_decay=a.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, config: RunConfig):
    a = config.actor
    total = max(1, config.trainer.steps * config.algorithm.updates_per_batch)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, schedule=a.lr_schedule, warmup_steps=a.warmup_steps, total_steps=total),
    )


def hf_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` of the model's state dict in HF names, each storage once.

    Tied weights (``lm_head.weight`` sharing ``model.embed_tokens.weight``) are yielded once, under the
    first name in state-dict order, which is what ``save_pretrained`` writes (it drops the tied
    ``lm_head.weight``; the loader re-ties from ``tie_word_embeddings``). Tensors are detached views of
    the live weights (no copy): consume them before the next optimizer step.
    """
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        yield name, t.detach()


def _atomic_dir_swap(tmp: Path, dest: Path) -> None:
    old = None
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{os.getpid()}"
        os.replace(dest, old)
    os.replace(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------ the actor


class TorchActor(Actor):
    """Single-process actor (CPU or one GPU). See the module doc for the reusable pieces."""

    def __init__(
        self,
        *,
        config: RunConfig,
        adapter: ModelAdapter,
        tokenizer: Any = None,
        model: torch.nn.Module | None = None,
        before_backward: BeforeBackward | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        self.config = config
        self.adapter = adapter
        self.tokenizer = tokenizer
        self.before_backward = before_backward
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if model is None:
            if tokenizer is None:
                self.tokenizer = tokenizer = adapter.build_tokenizer(config)
            model = adapter.build_model(config, tokenizer)
        model = model.to(device=self.device, dtype=torch.float32)  # fp32 master weights
        model.config.use_cache = False
        if config.actor.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = model
        self.value_head: torch.nn.Linear | None = None
        if config.actor.value_head:
            # zero init: V = 0 everywhere at the start, deterministic without touching the RNG
            self.value_head = torch.nn.Linear(model.config.hidden_size, 1).to(self.device)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
        self.optimizer = build_optimizer(self._train_params(), config)
        self.scheduler = build_scheduler(self.optimizer, config)
        self._sft_optimizer: torch.optim.Optimizer | None = None
        self.reference: torch.nn.Module | None = None
        self.step = 0
        if config.algorithm.kl_coef > 0:
            self.snapshot_reference()

    # -------------------------------------------------------------------- parameters
    def _train_params(self) -> list[torch.nn.Parameter]:
        return train_params(self.model, self.value_head)

    @property
    def sft_optimizer(self) -> torch.optim.Optimizer:
        """A separate AdamW at ``sft.lr`` (created on first use) so the RL optimizer state stays clean."""
        if self._sft_optimizer is None:
            self._sft_optimizer = build_optimizer(list(self.model.parameters()), self.config, lr=self.config.sft.lr)
        return self._sft_optimizer

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
    def _replay(self, model: torch.nn.Module, samples: Sequence[Sample], *, values: bool = False) -> list[Tensor]:
        out: list[Tensor] = []
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for micro in chunks(samples, self.config.actor.micro_batch_size):
                    packed = pack(micro).to(self.device)
                    logp, _, vals = forward_logprobs(model, packed, value_head=self.value_head if values else None)
                    flat = vals if values else logp
                    out.extend(t.float().cpu() for t in packed.split(flat.detach()))
        finally:
            model.train(was_training)
        return out

    def logprobs(self, samples: list[Sample]) -> list[Tensor]:
        return self._replay(self.model, samples)

    def values(self, samples: list[Sample]) -> list[Tensor]:
        if self.value_head is None:
            return super().values(samples)
        return self._replay(self.model, samples, values=True)

    def ref_logprobs(self, samples: list[Sample]) -> list[Tensor]:
        if self.reference is None:
            raise RuntimeError("no reference policy (algorithm.kl_coef is 0, or snapshot_reference not called)")
        return self._replay(self.reference, samples)

    # -------------------------------------------------------------------- updates
    def _clip_and_step(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> float:
        clip = self.config.actor.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=clip if clip > 0 else math.inf)
        optimizer.step()
        return float(grad_norm)

    def train_step(self, samples: list[Sample], batch: dict[str, list[Tensor]]) -> dict[str, float]:
        if not samples:
            raise ValueError("train_step needs at least one sample")
        total_tokens, total_seqs = step_denominators(samples)
        mbs = self.config.actor.micro_batch_size
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        parts = []
        for start in range(0, len(samples), mbs):
            micro = samples[start : start + mbs]
            mb = {k: (v[start : start + mbs] if v is not None else None) for k, v in batch.items()}
            loss, metrics = micro_batch_loss(
                self.model, micro, mb, config=self.config, total_tokens=total_tokens, total_seqs=total_seqs,
                value_head=self.value_head, reference=self.reference, before_backward=self.before_backward,
                device=self.device,
            )
            if loss.requires_grad:
                loss.backward()
            parts.append(metrics)
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm = self._clip_and_step(self.optimizer, self._train_params())
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        out = reduce_metrics(parts)
        out.update(grad_norm=grad_norm, lr=lr, tokens=total_tokens)
        return out

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """One supervised step: cross-entropy on the response tokens, own AdamW at ``sft.lr``."""
        if not samples:
            raise ValueError("sft_step needs at least one sample")
        total_tokens, _ = step_denominators(samples)
        opt = self.sft_optimizer
        self.model.train()
        opt.zero_grad(set_to_none=True)
        parts = []
        for micro in chunks(samples, self.config.actor.micro_batch_size):
            loss, metrics = sft_micro_batch_loss(self.model, micro, total_tokens=total_tokens)
            if loss.requires_grad:
                loss.backward()
            parts.append(metrics)
        grad_norm = self._clip_and_step(opt, list(self.model.parameters()))
        opt.zero_grad(set_to_none=True)
        out = reduce_metrics(parts)
        out.update(grad_norm=grad_norm, lr=opt.param_groups[0]["lr"], tokens=total_tokens)
        return out

    # -------------------------------------------------------------------- weights out
    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        return hf_named_weights(self.model)

    def export_hf(self, path: str) -> None:
        """``save_pretrained`` (safetensors, fp32, tied weights once) + tokenizer, via a temp dir rename."""
        dest = Path(path).absolute()
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self.model.save_pretrained(str(tmp))
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(tmp))
            _atomic_dir_swap(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    # -------------------------------------------------------------------- checkpoints
    def save(self, path: str, extra: Mapping[str, Any] | None = None) -> None:
        """Atomic checkpoint at ``path`` (see :mod:`unirl.actor.checkpoint`); ``extra`` is the trainer's."""
        stateful = {"sft_optimizer": self._sft_optimizer} if self._sft_optimizer is not None else {}
        save_checkpoint(
            path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            value_head=self.value_head, reference=self.reference, stateful=stateful,
            extra={"actor": {"step": self.step}, "trainer": dict(extra or {})},
        )

    def load(self, path: str) -> dict[str, Any]:
        """Restore a checkpoint (or the one ``path/latest`` names); return the trainer's ``extra``."""
        held = checkpoint_states(path)
        if "reference" in held and self.reference is None and self.config.algorithm.kl_coef > 0:
            self.reference = self._new_reference()
        stateful = {"sft_optimizer": (lambda: self.sft_optimizer)} if "sft_optimizer" in held else {}
        extra = load_checkpoint(
            path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            value_head=self.value_head, reference=self.reference, stateful=stateful,
        )
        self.step = int(extra.get("actor", {}).get("step", 0))
        return dict(extra.get("trainer", {}))
