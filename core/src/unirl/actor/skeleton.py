"""The actor skeleton: everything an actor does the same way, written once.

Both the embedded actor (:class:`unirl.actor.torch_actor.TorchActor`) and each rank of the FSDP
actor (``unirl_fsdp.worker.FSDPWorker``) are an :class:`ActorSkeleton`. The skeleton owns the math
and the loops; a distributed actor overrides only the distribution seams:

* :meth:`ActorSkeleton._micro_batches` - how a batch is cut (FSDP: padding micro-batches so every rank
  runs the same number of collectives);
* :meth:`ActorSkeleton._place_head` - where a fresh value head lives (FSDP: its own sharded unit);
* :meth:`ActorSkeleton._full` - the whole tensor behind a sharded one (FSDP: ``DTensor.full_tensor``);
* :meth:`ActorSkeleton._agree` - how a before-backward failure is raised (FSDP: all-reduced, so every
  rank raises together and none is left inside a collective);
* :meth:`ActorSkeleton._after_replay` - clean-up after no-grad forwards (FSDP: reshard).

The reusable per-micro-batch math lives in module-level functions:

* :func:`forward_logprobs` - one packed forward -> per-response-token fp32 log-probs (+ entropy, values),
  the whole logits never held at once (:mod:`unirl.actor.chunked_logprobs`)
* :func:`micro_batch_loss` - policy loss (+ value loss) of one micro-batch, sum-form with global denominators
* :func:`sft_micro_batch_loss` - supervised cross-entropy of one micro-batch, sum-form
* :func:`step_denominators` - ``(total_tokens, total_seqs)`` of a whole optimizer-step batch
* :func:`reduce_metrics` - combine micro-batch metrics (sum / max per the loss's ``metric_reduce``)
* :func:`build_optimizer`, :func:`build_scheduler` - AdamW and the warmup + decay LR schedule
* :func:`hf_named_weights`, :func:`write_hf_dir` - the weights in HF names, an HF directory
  (:mod:`unirl.actor.hf_weights`, re-exported here)

Because every micro-batch loss is divided by denominators computed once over the whole step, summing
the micro-batch gradients gives exactly the full-batch gradient: ``actor.micro_batch_size`` changes
memory, not the update (``tests/test_torch_actor.py`` checks 1 vs 4 vs all to 1e-6). An FSDP actor
computes the denominators over all ranks and sums (not averages) gradients over them.

Nothing here resolves a plugin: the policy loss, metric reductions and parity context come from the
:class:`unirl.runtime.Runtime` the trainer built from its one kernel.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from unirl import routing
from unirl.actor import activation_checkpointing
from unirl.actor.chunked_logprobs import forward_logprobs
from unirl.actor.held_versions import HeldVersions
from unirl.actor.hf_weights import hf_named_weights, write_hf_dir  # noqa: F401 - re-exported
from unirl.algorithms.losses import LossInputs, LossSettings, value_loss
from unirl.contracts import BackwardContext, BeforeBackward, StepInfo
from unirl.kernel.errors import UniRLError
from unirl.logprobs import LogprobProcessing
from unirl.mismatch.stats import log_ratio_sums
from unirl.packing import PackedBatch, enable_packed_attention, flatten, pack, slack_for
from unirl.samples import Sample

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import RunConfig
    from unirl.runtime import Runtime


class ActorInputError(UniRLError, ValueError):
    """A train / replay call got inputs the configuration cannot use; the message names the field."""


# ------------------------------------------------------------------------------------ reusable math


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


def _pi_old(batch_tensors: Mapping[str, Sequence[Tensor] | None], packed: PackedBatch, device: torch.device,
            logp: Tensor) -> tuple[Tensor, Tensor | None, Any]:
    """pi_old's log-probs: ``batch['old_logprobs']``, else this forward's own, detached (pi_old is the policy
    this forward runs, see Actor.train_step). In that case, with ``batch['rollout_logprobs']``, also the
    replay's diagnostic from this forward: the largest engine-vs-trainer gap and the mismatch sums
    (:mod:`unirl.mismatch`); otherwise those are None."""
    old = _flat(batch_tensors, "old_logprobs", packed, device)
    engine_gap = mismatch = None
    if old is None:
        old = logp.detach()
        rollout = _flat(batch_tensors, "rollout_logprobs", packed, device)
        if rollout is not None:
            gap = (old - rollout).abs().masked_fill(packed.mask <= 0, 0.0)
            engine_gap = gap.max() if gap.numel() else old.new_zeros(())
            mismatch = log_ratio_sums(rollout, old, packed.mask)  # the total term's sums (unirl.mismatch)
    return old, engine_gap, mismatch


def _value_term(values: Tensor, batch_tensors: Mapping[str, Sequence[Tensor] | None], packed: PackedBatch,
                device: torch.device, config: RunConfig, total_tokens: float) -> tuple[Tensor, Mapping[str, Tensor]]:
    """``algorithm.value_coef`` times the value head's loss on this micro-batch, and its metrics."""
    alg = config.algorithm
    returns = _flat(batch_tensors, "returns", packed, device)
    old_values = _flat(batch_tensors, "old_values", packed, device)
    if returns is None or old_values is None:
        raise ActorInputError("actor.value_head: true needs batch['returns'] and batch['old_values'] "
                              "(use a value estimator such as gae, or set actor.value_head: false)")
    vloss, vmetrics = value_loss(values, old_values, returns, packed.mask, clip=alg.value_clip,
                                 total_tokens=total_tokens)
    return alg.value_coef * vloss, vmetrics


def micro_batch_loss(
    model: torch.nn.Module,
    micro_samples: Sequence[Sample],
    batch_tensors: Mapping[str, Sequence[Tensor] | None],
    *,
    config: RunConfig,
    loss_fn: Callable[[LossInputs, LossSettings], tuple[Tensor, Mapping[str, Tensor]]],
    settings: LossSettings,
    total_tokens: float,
    total_seqs: float,
    value_head: torch.nn.Module | None = None,
    reference: torch.nn.Module | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """Policy loss ``loss_fn`` (+ ``value_coef`` * value loss) of one micro-batch, sum-form with the
    step's global denominators: call ``backward()`` on it as is and sum over micro-batches.

    ``loss_fn`` is the run's ``runtime.policy_loss``, called as ``loss_fn(inp, settings)`` with
    ``settings`` the run's ``runtime.loss_settings``. ``batch_tensors`` holds this micro-batch's per-sample 1-D
    tensors: ``advantages`` (required), ``old_logprobs`` (absent: this forward's own detached log-probs,
    i.e. pi_old is the current policy), ``ref_logprobs`` (else computed with
    ``reference`` when ``kl_coef > 0``), ``token_weights``, and with a value head ``returns`` +
    ``old_values``. Returns ``(loss, metrics, logp)``: metrics are detached 0-d tensors in sum form
    (see :func:`reduce_metrics`), including ``entropy``; ``logp`` is the detached fp32 selected-token
    log-probs ``[N]``, the responses concatenated in sample order (what the before-backward hook sees).
    """
    alg = config.algorithm
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    aux: dict[str, Tensor] | None = {} if alg.router_aux_loss_coef > 0 else None
    # the router aux loss reads every token of the row: no padding for it
    packed = pack(micro_samples, uniform_slack=slack_for(model) if aux is None else 0.0).to(device)
    replay = routing.prepare(model, micro_samples, packed)  # R3: the recorded experts of this forward
    processing = LogprobProcessing.of_run(config)
    logp, entropy, values = forward_logprobs(model, packed, with_entropy=True, value_head=value_head, router_aux=aux,
                                             processing=processing)
    adv = _flat(batch_tensors, "advantages", packed, device)
    if adv is None:
        raise ActorInputError("train_step needs batch['advantages'] "
                              "(the trainer computes them; a custom loop must pass them)")
    old, engine_gap, mismatch = _pi_old(batch_tensors, packed, device, logp)
    ref = _flat(batch_tensors, "ref_logprobs", packed, device)
    if ref is None and alg.kl_coef > 0:
        if reference is None:
            raise ActorInputError("algorithm.kl_coef > 0 needs batch['ref_logprobs'] or a reference model: "
                                  "call snapshot_reference() or set algorithm.kl_coef: 0")
        with torch.no_grad():
            ref, _, _ = forward_logprobs(reference, packed, processing=processing)
    inp = LossInputs(logprobs=logp, old_logprobs=old, advantages=adv, mask=packed.mask,
                     seq_index=packed.seq_index, seq_lens=packed.seq_lens, total_tokens=total_tokens,
                     total_seqs=total_seqs, ref_logprobs=ref,
                     token_weights=_flat(batch_tensors, "token_weights", packed, device))
    loss, metrics = loss_fn(inp, settings)
    metrics = dict(metrics)
    if value_head is not None:
        vterm, vmetrics = _value_term(values, batch_tensors, packed, device, config, total_tokens)
        loss = loss + vterm
        metrics.update(vmetrics)
    tok = total_tokens if total_tokens > 0 else 1.0
    if aux is not None:  # router load balancing, weighted by this micro-batch's share of the step's tokens
        if aux["aux_loss"] is None:
            raise ActorInputError("algorithm.router_aux_loss_coef > 0 needs a Mixture-of-Experts model whose "
                                  "output has aux_loss (e.g. model.adapter: qwen3_moe); set it to 0")
        share = packed.mask.sum() / tok
        loss = loss + alg.router_aux_loss_coef * aux["aux_loss"] * share
        metrics["router_aux_loss"] = aux["aux_loss"].detach() * share
    metrics["entropy"] = (entropy * packed.mask).sum() / tok
    metrics.update(routing.step_metrics(replay, packed.mask.sum() / tok))
    metrics["loss"] = loss.detach()
    if engine_gap is not None:
        metrics["rollout_replay_max_diff"] = engine_gap
    if mismatch is not None:  # sum-reduced over micro-batches and ranks; the trainer pops them
        metrics.update(mismatch.as_tensor_metrics())
    return loss, metrics, logp.detach()


def sft_micro_batch_loss(
    model: torch.nn.Module, micro_samples: Sequence[Sample], *, total_tokens: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-mean cross-entropy on the response tokens (``loss_mask``), sum-form over ``total_tokens``.
    Only the masked-in tokens' logits are computed (:meth:`PackedBatch.masked_in`)."""
    device = next(model.parameters()).device
    packed = pack(micro_samples, uniform_slack=slack_for(model)).masked_in().to(device)
    logp, entropy, _ = forward_logprobs(model, packed, with_entropy=True)
    tok = total_tokens if total_tokens > 0 else 1.0
    loss = -(logp * packed.mask).sum() / tok
    return loss, {"sft_loss": loss.detach(), "entropy": (entropy * packed.mask).sum() / tok}


def reduce_metrics(parts: Sequence[Mapping[str, Any]], metric_reduce: Mapping[str, str]) -> dict[str, float]:
    """Combine micro-batch metrics: summed (already divided by global denominators) except the keys
    ``metric_reduce`` (``runtime.metric_reduce``, the loss's own) marks "max". An FSDP actor reduces the
    parts of every rank the same way."""
    out: dict[str, float] = {}
    for m in parts:
        for k, v in m.items():
            x = float(v)
            if metric_reduce.get(k, "sum") == "max":
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
    raise ActorInputError(f"actor.lr_schedule: unknown schedule {schedule!r} (use constant, linear or cosine)")


def train_params(model: torch.nn.Module, value_head: torch.nn.Module | None) -> list[torch.nn.Parameter]:
    """What the RL optimizer steps: the policy's trainable parameters (with ``actor.lora``, the adapter
    only: peft freezes the base), plus the value head when there is one."""
    params = [p for p in model.parameters() if p.requires_grad]
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


def new_value_head(hidden_size: int) -> torch.nn.Linear:
    """The value head: zero init, so V = 0 everywhere at the start, deterministic without the RNG."""
    head = torch.nn.Linear(hidden_size, 1)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    return head


# ------------------------------------------------------------------------------------------ skeleton


def micro_batch_bounds(samples: Sequence[Sample], size: int, max_tokens: int | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` of each micro-batch of ``samples``, in order: at most ``size`` samples and, with
    ``max_tokens`` (``actor.micro_batch_tokens``), at most that many tokens, a longer sample alone.

    Why tokens too: a micro-batch's activations grow with its tokens, so a count that suits 64-token
    responses holds four times the memory at 256. On CPU the smaller micro-batch is faster as well: its
    buffers are reused instead of being faulted in afresh (``benchmarks/vs_trl.py``, 25 M x 256 bf16).
    One function for the skeleton's cut and a distributed driver's plan, so both count alike."""
    bounds: list[tuple[int, int]] = []
    start = tokens = 0
    for i, s in enumerate(samples):
        n = len(s.prompt_ids) + len(s.response_ids)
        if i > start and (i - start >= size or (max_tokens is not None and tokens + n > max_tokens)):
            bounds.append((start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(samples):
        bounds.append((start, len(samples)))
    return bounds


@dataclass
class MicroBatch:
    """One forward/backward: the samples the model runs, their batch tensors, and how many of the
    samples are real. The rest (``samples[real:]``) are padding a distributed actor added."""

    samples: list[Sample]
    batch: dict[str, list[Tensor] | None] = field(default_factory=dict)
    real: int = 0


class ActorSkeleton(HeldVersions):
    """The replay loop, the micro-batch train loop (loss, gate, backward), clip-and-step and SFT,
    shared by every actor. Subclasses set up :attr:`model` and call :meth:`_setup_training`."""

    rank: int = 0
    world_size: int = 1

    config: RunConfig
    runtime: Runtime
    device: torch.device
    model: torch.nn.Module

    def _init_skeleton(self, config: RunConfig, runtime: Runtime) -> None:
        self.config, self.runtime = config, runtime
        self.before_backward: BeforeBackward | None = None
        self.value_head: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        self._sft_optimizer: torch.optim.Optimizer | None = None
        self._sft_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.step = 0
        self._held: dict[int, list[Tensor]] = {}  # weight versions kept (unirl.actor.held_versions)

    def _prepare_model(self, model: torch.nn.Module, *, device: torch.device | None,
                       trainable: bool = True) -> torch.nn.Module:
        """fp32 master weights on ``device`` (None: where they are), no KV cache, packed attention
        (:func:`unirl.packing.enable_packed_attention`: a decoder on sdpa attends within each packed
        sequence), activation checkpointing as ``actor.activation_checkpointing`` says (trainable models
        only; :mod:`unirl.actor.activation_checkpointing`)."""
        model = model.to(dtype=torch.float32)
        if device is not None:
            model = model.to(device)
        model.config.use_cache = False
        enable_packed_attention(model)  # attention within each packed sequence, not over the whole row
        if trainable:
            activation_checkpointing.enable(model, self.config.actor.activation_checkpointing)
        return model

    def _setup_training(self) -> None:
        """Value head (``actor.value_head``), RL optimizer + scheduler, KL reference (``kl_coef > 0``)."""
        routing.install(self.config, self.adapter, self.model)  # R3's replay hooks (algorithm.routing_replay)
        if self.config.actor.value_head:
            self.value_head = self._place_head(new_value_head(self.model.config.hidden_size))
        self.optimizer = build_optimizer(self._train_params(), self.config)
        self.scheduler = build_scheduler(self.optimizer, self.config)
        if self.config.algorithm.kl_coef > 0:
            self.snapshot_reference()

    def snapshot_reference(self) -> None:  # pragma: no cover - every actor defines it
        raise NotImplementedError

    # ------------------------------------------------------------------ distribution seams
    def _place_head(self, head: torch.nn.Module) -> torch.nn.Module:
        return head.to(self.device)

    @staticmethod
    def _full(t: Tensor) -> Tensor:
        """The whole tensor behind a possibly sharded one (identity here)."""
        return t

    def _agree(self, error: BaseException | None) -> None:
        """Raise the before-backward error of this micro-batch, if any."""
        if error is not None:
            raise error

    def _after_replay(self) -> None:
        """Called after every replay (no-grad forwards)."""

    def _micro_batches(self, samples: Sequence[Sample], batch: Mapping[str, Sequence[Tensor] | None] | None = None,
                       *, size: int | None = None, count: int | None = None) -> list[MicroBatch]:
        """Cut ``samples`` (and ``batch``, aligned) into micro-batches of ``size`` (``actor.micro_batch_size``)
        and ``actor.micro_batch_tokens`` (:func:`micro_batch_bounds`). ``count`` is a distributed actor's
        planned number (unused here)."""
        size = size or self.config.actor.micro_batch_size
        out = []
        for start, end in micro_batch_bounds(samples, size, self.config.actor.micro_batch_tokens):
            micro = list(samples[start:end])
            mb = {k: (list(v[start:end]) if v is not None else None) for k, v in (batch or {}).items()}
            out.append(MicroBatch(micro, mb, len(micro)))
        return out

    # ------------------------------------------------------------------ parameters
    def _train_params(self) -> list[torch.nn.Parameter]:
        return train_params(self.model, self.value_head)

    @property
    def sft_optimizer(self) -> torch.optim.Optimizer:
        """A separate AdamW at ``sft.lr`` (created on first use) so the RL optimizer state stays clean, with
        its own schedule over ``sft.steps`` (``sft.lr_schedule``)."""
        if self._sft_optimizer is None:
            sft = self.config.sft
            self._sft_optimizer = build_optimizer(train_params(self.model, None), self.config, lr=sft.lr)
            self._sft_scheduler = torch.optim.lr_scheduler.LambdaLR(
                self._sft_optimizer,
                lambda step: lr_factor(step, schedule=sft.lr_schedule, warmup_steps=sft.warmup_steps,
                                       total_steps=max(1, sft.steps)))
        return self._sft_optimizer

    # ------------------------------------------------------------------ replay
    def _replay(self, model: torch.nn.Module, samples: Sequence[Sample], *, phase: str, values: bool = False,
                count: int | None = None) -> list[Tensor]:
        """No-grad forwards over micro-batches, each inside ``runtime.exact(phase)``: per-sample fp32
        log-probs (or values) on the CPU, in sample order."""
        out: list[Tensor] = []
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), self._compute():  # once: each weight cast once (``_compute`` says why)
                for mb in self._micro_batches(samples, count=count):
                    packed = pack(mb.samples, uniform_slack=slack_for(model)).to(self.device)
                    routing.prepare(model, mb.samples, packed)  # R3 (a no-op for a model without replay)
                    with self.runtime.exact(phase):
                        logp, _, vals = forward_logprobs(model, packed,
                                                         value_head=self.value_head if values else None,
                                                         processing=LogprobProcessing.of_run(self.config))
                    flat = vals if values else logp
                    out.extend([t.float().cpu() for t in packed.split(flat.detach())][:mb.real])
        finally:
            model.train(was_training)
            self._after_replay()
        return out

    def _compute(self) -> contextlib.AbstractContextManager[Any]:
        """The actor's compute precision, entered around every forward (and its backward). Here fp32 as
        the weights are; the embedded actor's ``compute_dtype: bfloat16`` returns autocast (FSDP casts
        its parameters instead, ``MixedPrecisionPolicy``).

        An update enters it once around all its micro-batches, not once per micro-batch: autocast keeps
        the low-precision copy of each weight until its outermost context exits, and the weights do not
        change until the optimizer steps, so each is cast once per update. Entered per micro-batch, every
        micro-batch cast every weight again (and selective checkpointing's recompute once more): ~0.1 s
        per cast of the 100 M model on 2 CPU cores, 0.4-0.5 s of a 13 s train phase at 5 micro-batches
        (benchmarks/README.md). The values cast are the same, so the gradients are too, bit for bit."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ updates
    def _backward(self, loss: Tensor) -> None:
        if loss.requires_grad:
            loss.backward()

    def _clip_and_step(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> float:
        """Clip to ``actor.grad_clip`` (0: no clip), step; return the pre-clip global grad norm.

        A non-finite global norm (a NaN / Inf loss or gradient anywhere, on any rank: the norm is global)
        drops the update: no optimizer step, so the weights and the optimizer state stay as they were
        (``algorithm.nonfinite`` decides whether the run goes on)."""
        clip = self.config.actor.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=clip if clip > 0 else math.inf)
        norm = float(self._full(norm))
        if math.isfinite(norm):
            optimizer.step()
        return norm

    def _first_nonfinite(self, parts: list[dict[str, float]]) -> str:
        """What was not finite first: the loss, else the first parameter whose gradient holds NaN / Inf
        (on this rank's shard), for the abort message."""
        if any(not math.isfinite(p.get("loss", 0.0)) for p in parts):
            return "loss"
        for name, p in self.model.named_parameters():
            try:
                bad = p.grad is not None and not bool(torch.isfinite(p.grad).all())
            except Exception:  # noqa: BLE001 - a sharded grad this rank cannot read: keep looking
                bad = False
            if bad:
                return f"gradient of {name}"
        return "gradient norm"

    def _backward_context(self, info: StepInfo, index: int, mb: MicroBatch, logp: Tensor) -> BackwardContext:
        """What the before-backward hook sees for ``mb``: its real samples, their log-probs and rollout
        log-probs (a padding micro-batch: no samples, empty tensors)."""
        real = mb.samples[:mb.real]
        n = sum(len(s.response_ids) for s in real)
        rollout = list(mb.batch.get("rollout_logprobs") or [])[:mb.real]
        flat = [torch.as_tensor(t).detach().reshape(-1).float() for t in rollout]
        rollout_t = torch.cat(flat).to(logp.device) if flat else torch.zeros(0, device=logp.device)
        return BackwardContext(rl_step=info.rl_step, update=info.update, micro_batch=index, rank=self.rank,
                               world_size=self.world_size, samples=list(real), logprobs=logp[:n].float(),
                               rollout_logprobs=rollout_t)

    def _gate(self, ctx: BackwardContext) -> None:
        """Run the before-backward callback; a failure is raised through :meth:`_agree`."""
        if self.before_backward is None:
            return
        error: BaseException | None = None
        try:
            self.before_backward(ctx)
        except BaseException as exc:  # noqa: BLE001 - re-raised by _agree (collectively on FSDP)
            error = exc
        self._agree(error)

    def _accumulate(self, micros: Sequence[MicroBatch], info: StepInfo, *, total_tokens: float,
                    total_seqs: float, config: RunConfig | None = None) -> list[dict[str, float]]:
        """Loss, before-backward gate and backward of every micro-batch (gradients accumulate). Forward
        and backward run inside ``runtime.exact("train")`` (activation-checkpoint recompute included).
        Returns the metric parts of the micro-batches that hold real samples. A ``config`` given here
        replaces the run's for this call, its loss settings included (equivalence tests vary them); the
        loss's validated options stay the run's."""
        settings = self.runtime.loss_settings
        if config is not None and config is not self.config:
            settings = LossSettings.from_algorithm(config.algorithm, norm_len=config.rollout.max_new_tokens,
                                                   options=settings.options)
        config = config or self.config
        parts = []
        with self._compute():  # once for all micro-batches: each weight cast once (``_compute`` says why)
            for i, mb in enumerate(micros):
                with self.runtime.exact("train"):
                    loss, metrics, logp = micro_batch_loss(
                        self.model, mb.samples, mb.batch, config=config, loss_fn=self.runtime.policy_loss,
                        settings=settings,
                        total_tokens=total_tokens, total_seqs=total_seqs, value_head=self.value_head,
                        reference=self.reference, device=self.device)
                    self._gate(self._backward_context(info, i, mb, logp))
                    self._backward(loss)
                if mb.real:
                    parts.append({k: float(v) for k, v in metrics.items()})
        return parts

    def _train_update(self, micros: Sequence[MicroBatch], info: StepInfo, *, total_tokens: float,
                      total_seqs: float) -> dict[str, Any]:
        """One RL optimizer update: ``{"parts", "grad_norm", "lr"}``. A raising gate leaves the weights,
        the optimizer and the step counter as they were (the next update starts from clean gradients)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        try:
            parts = self._accumulate(micros, info, total_tokens=total_tokens, total_seqs=total_seqs)
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm = self._clip_and_step(self.optimizer, self._train_params())
        out = {"parts": parts, "grad_norm": grad_norm, "lr": lr}
        if math.isfinite(grad_norm):
            self.scheduler.step()
            self.step += 1
        else:  # dropped: the schedule does not advance either
            out["nonfinite_first"] = self._first_nonfinite(parts)
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def _sft_update(self, micros: Sequence[MicroBatch], *, total_tokens: float) -> dict[str, Any]:
        """One supervised update with the SFT optimizer: ``{"parts", "grad_norm", "lr"}``."""
        opt = self.sft_optimizer
        self.model.train()
        opt.zero_grad(set_to_none=True)
        parts = []
        with self._compute():  # once for all micro-batches, as in ``_accumulate``
            for mb in micros:
                with self.runtime.exact("train"):
                    loss, metrics = sft_micro_batch_loss(self.model, mb.samples, total_tokens=total_tokens)
                    self._backward(loss)
                if mb.real:
                    parts.append({k: float(v) for k, v in metrics.items()})
        lr = opt.param_groups[0]["lr"]
        grad_norm = self._clip_and_step(opt, train_params(self.model, None))
        opt.zero_grad(set_to_none=True)
        self._sft_scheduler.step()  # counts dropped updates too: the schedule follows sft.steps, not luck
        return {"parts": parts, "grad_norm": grad_norm, "lr": lr}


def step_metrics(outs: Sequence[Mapping[str, Any]], metric_reduce: Mapping[str, str], *,
                 tokens: float) -> dict[str, float]:
    """The metrics of one update from the ``_train_update`` / ``_sft_update`` result of every rank."""
    out = reduce_metrics([p for o in outs for p in o["parts"]], metric_reduce)
    out.update(grad_norm=outs[0]["grad_norm"], lr=outs[0]["lr"], tokens=tokens)
    first = next((o["nonfinite_first"] for o in outs if "nonfinite_first" in o), None)
    if first is not None:  # a dropped update (only then: the metrics of a finite run stay as they were)
        out["nonfinite_first"] = first
    return out


def check_samples(samples: Sequence[Sample], what: str) -> None:
    if not samples:
        raise ActorInputError(f"{what} needs at least one sample (an empty batch has no loss to step on)")
