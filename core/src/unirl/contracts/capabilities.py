"""What components declare about themselves, so preflight and the trainer read declarations instead
of comparing names (docs/architecture.md: "declarations, never names")."""

from __future__ import annotations

from dataclasses import dataclass
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
    """

    weight_syncs: tuple[str, ...]
    logprobs: Literal["raw", "processed"] = "raw"
    continuation: bool = True
    async_submit: bool = True
    lora_adapters: bool = False
    requests_across_sync: Literal["none", "queued"] = "none"


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
