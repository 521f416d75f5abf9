"""The UniRL hook specifications: the whole contract between the kernel and its plugins.

Every heavy capability (an engine, an actor, a loss, a reward ...) reaches a run through one of the
hooks below. A plugin is a module (found through the ``unirl.plugins`` entry-point group) that
defines functions named like these specs and decorated with :data:`hookimpl`.

Two kinds of hooks:

* **Capability hooks** return ``{name: factory}``. The kernel merges the answers of every plugin into a
  named registry and rejects a name registered twice, naming both distributions. A factory is either a
  callable or a lazy ``"package.module:attr"`` string; the string form keeps ``unirl plugins`` from
  importing torch, vLLM or Ray just to list what is there. A factory class may carry a pydantic
  ``Config`` attribute: the kernel validates the component's ``options`` against it.
* **Lifecycle hooks** are called at fixed points of a run, with keyword arguments only (pluggy passes
  arguments by name, so a plugin may accept any subset of them).

Hooks are kept few on purpose: a hook is added only when a plugin needs it.
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT = "unirl"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Factories = dict[str, Any]

# --------------------------------------------------------------------------------------------------
# Capability hooks: each returns {name: factory}. Registry name = hook name without the prefix.
# --------------------------------------------------------------------------------------------------


@hookspec
def unirl_rollout_engines() -> Factories:
    """Rollout engines, selected by ``rollout.engine``.

    A factory is called as ``factory(config=RunConfig, adapter=ModelAdapter, tokenizer=...)`` and
    returns an object with ``generate(samples, sampling) -> samples`` (see
    :class:`unirl.contracts.RolloutEngine`); it reads its own ``rollout.options``, which preflight
    has already validated against the factory's ``Config`` model.
    Example: ``{"vllm": "unirl_vllm.engine:VLLMEngine"}``.
    """


@hookspec
def unirl_actors() -> Factories:
    """Train backends (actors), selected by ``actor.name``; see :class:`unirl.contracts.Actor`."""


@hookspec
def unirl_weight_syncs() -> Factories:
    """Weight-sync transports, selected by ``weight_sync.name``.

    A transport moves an actor's weights into an engine and returns one receipt per engine worker; the
    trainer advances the version ledger only when every receipt agrees (see
    :class:`unirl.contracts.WeightSync`).
    """


@hookspec
def unirl_advantage_estimators() -> Factories:
    """Advantage estimators (``grpo``, ``rloo``, ``gae`` ...), selected by ``algorithm.estimator``."""


@hookspec
def unirl_policy_losses() -> Factories:
    """Policy losses, selected by ``algorithm.loss`` (``ppo_clip`` is built in).

    A loss is called exactly like :func:`unirl.algorithms.losses.ppo_clip`:
    ``fn(LossInputs, *, clip_low, clip_high, agg, total_tokens, total_seqs, norm_len, ref_logprobs,
    kl_coef, kl_estimator, token_weights) -> (loss, metrics)``, returning the micro-batch's sum-form
    loss with the step's global denominators, so every actor (embedded or FSDP) can use it unchanged.
    """


@hookspec
def unirl_loss_modifiers() -> Factories:
    """Policy-loss modifiers, listed in ``algorithm.modifiers``.

    A modifier is called once per step as ``modifier(samples, batch, config)`` after advantages and
    pi_old are known; ``batch`` maps names to per-sample token tensors (``advantages``,
    ``old_logprobs``, ``rollout_logprobs`` ...). It may add or reweight ``token_weights``, which the
    policy loss multiplies per token: importance-sampling rollout correction is one.
    """


@hookspec
def unirl_rewards() -> Factories:
    """Reward functions, selected by ``reward.name``: ``fn(completion: str, sample) -> float``."""


@hookspec
def unirl_environments() -> Factories:
    """Multi-turn environments for agentic rollouts."""


@hookspec
def unirl_tools() -> Factories:
    """Tools an agent may call during an agentic rollout."""


@hookspec
def unirl_parity_providers() -> Factories:
    """Reference-op providers that make engine and trainer numerics bit-identical."""


@hookspec
def unirl_trace_exporters() -> Factories:
    """Exporters of rollout traces (e.g. Dynamo replay formats)."""


@hookspec
def unirl_model_adapters() -> Factories:
    """Model adapters, selected by ``model.adapter``.

    An adapter says how to build or load a model family, tokenize, map weight names for each engine,
    and which parity adapter applies. A third-party model arrives as a plugin returning one of these.
    """


CAPABILITY_HOOKS: tuple[str, ...] = (
    "unirl_rollout_engines",
    "unirl_actors",
    "unirl_weight_syncs",
    "unirl_advantage_estimators",
    "unirl_policy_losses",
    "unirl_loss_modifiers",
    "unirl_rewards",
    "unirl_environments",
    "unirl_tools",
    "unirl_parity_providers",
    "unirl_trace_exporters",
    "unirl_model_adapters",
)


def kind_of(hook_name: str) -> str:
    """``unirl_rollout_engines`` -> ``rollout_engines`` (the registry's name)."""
    return hook_name.removeprefix("unirl_")


# --------------------------------------------------------------------------------------------------
# Lifecycle hooks.
# --------------------------------------------------------------------------------------------------


@hookspec
def unirl_preflight(config: Any) -> list:
    """Check a resolved run config before anything expensive starts.

    Called once, before Ray starts or any model is built. Return a list of
    :class:`unirl.kernel.errors.Violation` (empty when all is well). Every plugin is asked and all
    violations are reported together, so a user fixes a recipe in one pass.
    """


@hookspec
def unirl_worker_env(config: Any) -> dict[str, str]:
    """Environment variables every worker process must see (Ray ``runtime_env``, spawned engines).

    The answers of all plugins are merged; two plugins setting one variable to different values is an
    error. Parity flags (``UNIRL_PARITY_ENABLE``) travel this way.
    """


@hookspec
def unirl_before_backward(step: int, samples: Any, logprobs: Any, config: Any) -> None:
    """Called after the loss is computed and before ``backward()``.

    ``logprobs`` are the trainer's fp32 selected-token log-probs of the micro-batch. The parity gate
    lives here: it raises to stop the step. Must be collective-safe on multi-rank actors (all ranks
    raise together).
    """


@hookspec
def unirl_on_rollout(step: int, samples: Any, config: Any) -> None:
    """Called once per step with the scored rollout batch (e.g. to capture a trace)."""


@hookspec
def unirl_on_step_end(step: int, metrics: dict, config: Any) -> None:
    """Called after the optimizer step with the step's metrics (mutable: a plugin may add keys)."""


@hookspec
def unirl_on_weights_published(version: int, receipts: list, config: Any) -> None:
    """Called after a weight sync committed ``version``, with every worker's receipt."""
