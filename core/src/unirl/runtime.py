"""What the trainer's kernel resolves once and hands to every component: one kernel per run.

Actors and engines never call ``load_kernel()``. The trainer builds a :class:`Runtime` from its own
kernel and passes it to each factory (``runtime=``). Everything in it pickles, so the FSDP ranks and a
vLLM host on Ray get the same thing: the resolved policy loss travels by reference, and
:class:`~unirl.kernel.manager.KernelHooks` rebuilds the same plugin set in the remote process (same
``UNIRL_PLUGINS`` allowlist, same entry points, plus the trainer's in-process registrations by
module name).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from unirl.contracts import BackwardContext, Capabilities, EstimatorTraits, ParityProvider, traits_of
from unirl.kernel.manager import Kernel, KernelHooks

if TYPE_CHECKING:  # pragma: no cover
    from unirl.algorithms.losses import LossSettings
    from unirl.config import RunConfig


class HookGate:
    """The before-backward callback built from the run's hooks: calls ``unirl_before_backward``.

    Picklable (it holds :class:`KernelHooks` and the config), so an FSDP rank runs the very plugins
    the trainer's kernel holds."""

    def __init__(self, hooks: KernelHooks, config: RunConfig) -> None:
        self.hooks, self.config = hooks, config

    def __call__(self, ctx: BackwardContext) -> None:
        self.hooks.call("unirl_before_backward", ctx=ctx, config=self.config)


@dataclass
class Runtime:
    """The trainer's resolved choices, for components (see the module doc).

    * ``policy_loss``: the function ``algorithm.loss`` names, called as ``policy_loss(inp, loss_settings)``;
    * ``loss_settings``: the run's frozen :class:`~unirl.algorithms.losses.LossSettings` (clip range,
      aggregation, KL, the loss's validated ``algorithm.loss_options``), built once here;
    * ``metric_reduce``: how that loss's metrics combine over micro-batches and ranks;
    * ``estimator``: the traits of ``algorithm.estimator`` (a sharded actor keeps groups together
      when ``needs_groups``);
    * ``estimator_options``: ``algorithm.estimator_options`` validated once, by the kernel, against the
      estimator's ``Config``; the trainer passes it to every call (None: the estimator declares none);
    * ``worker_env``: every plugin's ``unirl_worker_env``, merged: processes a component starts get it;
    * ``parity``: the enabled parity provider of the model family, or None;
    * ``capabilities``: what the selected engine, actor and controller declare
      (:class:`~unirl.contracts.Capabilities`, :mod:`unirl.declared`): the layout they run with, read
      by components and plugins instead of each other's names or raw options.
    """

    hooks: KernelHooks
    config: Any
    policy_loss: Callable[..., Any]
    loss_settings: LossSettings
    metric_reduce: Mapping[str, str]
    estimator: EstimatorTraits
    estimator_options: Any = None
    worker_env: dict[str, str] = field(default_factory=dict)
    parity: ParityProvider | None = None
    capabilities: Capabilities = field(default_factory=Capabilities)

    def exact(self, phase: str) -> contextlib.AbstractContextManager[Any]:
        """The parity provider's exact context for ``phase``, or a no-op."""
        return self.parity.exact_context(phase) if self.parity is not None else contextlib.nullcontext()

    def install_engine(self, engine: str) -> None:
        """Engine side of parity: call in the process that builds the engine's model, before building it."""
        if self.parity is not None:
            self.parity.install_engine(engine)

    def before_backward(self) -> HookGate | None:
        """The callback the trainer installs on its actor, or None when no plugin gates backward."""
        return HookGate(self.hooks, self.config) if self.hooks.implements("unirl_before_backward") else None


def build_runtime(config: RunConfig, kernel: Kernel, *, adapter: Any = None,
                  worker_env: Mapping[str, str] | None = None) -> Runtime:
    """Resolve the loss, its metric reductions, the estimator traits and parity from ``kernel``.

    The loss's and the estimator's options are validated here, once, by the kernel (a bad one raises
    :class:`~unirl.kernel.errors.OptionsError` naming the field; preflight reports the same error)."""
    from unirl.algorithms.losses import LossSettings, metric_reduce_of
    from unirl.declared import capabilities

    a = config.algorithm
    loss = kernel.get("policy_losses", a.loss).load()
    loss_options = kernel.options("policy_losses", a.loss, a.loss_options, "algorithm.loss_options")
    est = kernel.get("advantage_estimators", a.estimator).load()
    traits = traits_of(est)
    est_options = kernel.options("advantage_estimators", a.estimator, a.estimator_options,
                                 "algorithm.estimator_options", factory=est)
    parity = None
    name = getattr(adapter, "parity_adapter", None)
    if name and name in kernel.registries["parity_providers"]:
        provider = kernel.build("parity_providers", name, config=config)
        parity = provider if provider.enabled() else None
    env = dict(worker_env) if worker_env is not None else kernel.worker_env(config)
    settings = LossSettings.from_algorithm(a, norm_len=config.rollout.max_new_tokens, options=loss_options)
    return Runtime(hooks=KernelHooks(kernel), config=config, policy_loss=loss, loss_settings=settings,
                   metric_reduce=metric_reduce_of(loss), estimator=traits, estimator_options=est_options,
                   worker_env=env, parity=parity, capabilities=capabilities(config, kernel))
