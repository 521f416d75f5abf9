"""What components declare about themselves, so preflight and the trainer read declarations instead
of comparing names (docs/architecture.md: "declarations, never names")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


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

    The layout it will really run with, read from its validated options the way the engine applies them
    (the memory plan and plugins such as parity read these, never the engine's raw options or name):

    * ``workers``: workers that each hold a copy or a shard of the weights and answer a sync with a
      receipt (vLLM: replicas x tensor-parallel ranks);
    * ``tensor_parallel``: tensor-parallel ranks of one replica;
    * ``serve_dtype``: the weight dtype it serves when set apart from ``model.dtype`` (None: follows it);
    * ``eager``, ``prefix_cache``, ``chunked_prefill``: its switches (None: the engine has no such switch);
    * ``logprobs_mode``: the log-prob distribution in vLLM's words (``raw_logprobs``,
      ``processed_logits``, ...); None: ``{logprobs}_logprobs`` (see :attr:`served_logprobs`);
    * ``routing_record``: it records each sampled token's MoE expert ids onto ``Sample.routing`` (R3,
      ``algorithm.routing_replay``: :mod:`unirl.routing`); preflight refuses R3 with an engine that does not;
    * ``batching``: how it schedules rows. ``"continuous"``: a finished row's slot is refilled at the
      next step (vLLM, SGLang), the schedule Dynamo's mocker models, so a trace replay may predict
      per-request latency (unirl-replay-trace); None: not declared (the embedded engine: it merges whole
      jobs only, and runs a job larger than its batch in static chunks), and a replay then reports
      batch-level figures only;
    * ``fields``: (fact, config field that sets it) pairs, so a check names the field the user wrote.
    """

    weight_syncs: tuple[str, ...]
    logprobs: Literal["raw", "processed"] = "raw"
    continuation: bool = True
    async_submit: bool = True
    lora_adapters: bool = False
    requests_across_sync: Literal["none", "queued"] = "none"
    workers: int = 1
    tensor_parallel: int = 1
    serve_dtype: str | None = None
    eager: bool | None = None
    prefix_cache: bool | None = None
    chunked_prefill: bool | None = None
    logprobs_mode: str | None = None
    routing_record: bool = False
    batching: Literal["continuous"] | None = None
    fields: tuple[tuple[str, str], ...] = field(default=(), compare=False)  # where, not what: no part of equality

    @property
    def served_logprobs(self) -> str:
        """The distribution it returns, in vLLM's words (an engine with no mode switch: ``{logprobs}_logprobs``)."""
        return self.logprobs_mode or f"{self.logprobs}_logprobs"

    def field_of(self, fact: str, default: str = "rollout.options") -> str:
        """The config field that sets ``fact`` (``default`` when the engine names none)."""
        return dict(self.fields).get(fact, default)


#: dtype spellings an engine may accept, in ``model.dtype``'s words
_DTYPE_NAMES = {"bf16": "bfloat16", "float": "float32", "fp32": "float32"}


def dtype_name(value: Any) -> str | None:
    """``value`` (a dtype an engine option names: ``torch.bfloat16``, ``bf16``, ``float``) in
    ``model.dtype``'s words, so a declared ``serve_dtype`` compares with ``model.dtype``; None stays None."""
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    return _DTYPE_NAMES.get(name, name)


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


@dataclass(frozen=True)
class ActorCapabilities:
    """The layout an actor will really run with, answered by its ``capabilities(config, options)`` from
    its validated ``actor.options``, so preflight, the memory plan and plugins (parity) read one
    declaration instead of each re-reading the actor's raw options or assuming its defaults.

    * ``ranks``: processes that each hold a shard or a copy of the trained weights (FSDP's world size);
    * ``compute_dtype``: the dtype forward and backward compute in, set apart from ``model.dtype``
      (None: it computes in ``model.dtype``);
    * ``compiled``: parts of the model run through ``torch.compile`` (kernels of its own, other bits);
    * ``batching``: how it schedules rows. ``"continuous"``: a finished row's slot is refilled at the
      next step (vLLM, SGLang), the schedule Dynamo's mocker models, so a trace replay may predict
      per-request latency (unirl-replay-trace); None: not declared (the embedded engine: it merges whole
      jobs only, and runs a job larger than its batch in static chunks), and a replay then reports
      batch-level figures only;
    * ``fields``: (fact, config field that sets it) pairs, so a check names the field the user wrote.
    """

    ranks: int = 1
    compute_dtype: str | None = None
    compiled: bool = False
    fields: tuple[tuple[str, str], ...] = field(default=(), compare=False)  # where, not what: no part of equality

    def field_of(self, fact: str, default: str = "actor.options") -> str:
        """The config field that sets ``fact`` (``default`` when the actor names none)."""
        return dict(self.fields).get(fact, default)


@dataclass(frozen=True)
class ControllerCapabilities:
    """What a rollout controller drives, declared by its class (``capabilities(config)``), so preflight
    pairs it with ``rollout.environment`` from the declaration rather than from the controller's name.

    * ``drives_environments``: it runs a ``rollout.environment``'s turns (reset, step, close);
    * ``multi_turn``: a trajectory may hold several model turns (observations between them).
    """

    drives_environments: bool = False
    multi_turn: bool = False


@dataclass(frozen=True)
class Capabilities:
    """The selected components' declarations, resolved once by core (:func:`unirl.declared.resolve`):
    the ``Runtime`` carries them and every plugin's ``unirl_preflight`` may take them as
    ``capabilities``. A member is None when its component or options do not resolve (that is reported
    once, by the component's own check)."""

    engine: EngineCapabilities | None = None
    actor: ActorCapabilities | None = None
    controller: ControllerCapabilities | None = None
