"""The selected components' declarations (:class:`~unirl.contracts.Capabilities`), resolved once.

Why a module of its own: preflight, the ``Runtime`` and every plugin's ``unirl_preflight`` read the same
engine, actor and controller declarations; each asks the component's class with its options as the
kernel validated them (the one validation), so nobody re-reads raw options or compares names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unirl.contracts import (
    Actor,
    ActorCapabilities,
    Capabilities,
    ControllerCapabilities,
    EngineCapabilities,
    RolloutController,
    RolloutEngine,
)
from unirl.kernel.errors import OptionsError, PluginError, Violation

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import RunConfig
    from unirl.kernel.manager import Kernel

CORE = "unirl-core"


def _class(kernel: Kernel, kind: str, name: str | None, base: type) -> Any:
    """The registered class for ``name`` when it resolves to a ``base`` subclass, else None (its own
    selection check reports why)."""
    if not name:
        return None
    try:
        factory = kernel.get(kind, name).load()
    except PluginError:
        return None
    return factory if isinstance(factory, type) and issubclass(factory, base) else None


def _declared(kind: str, field: str, name: str, want: type, call: Any) -> Any:
    """``call()``, or a violation naming the plugin's bug when it raises or answers the wrong type."""
    try:
        caps = call()
    except Exception as exc:  # noqa: BLE001 - a broken declaration is the plugin's bug
        return Violation(CORE, field, f"capabilities() of '{name}' raised {exc!r}",
                         f"report it to the {kind}'s plugin")
    if not isinstance(caps, want):
        return Violation(CORE, field, f"capabilities() of '{name}' returned {type(caps).__name__}, not "
                         f"{want.__name__}", f"report it to the {kind}'s plugin")
    return caps


def _with_options(config: RunConfig, kernel: Kernel, kind: str, registry: str, name: str, raw: Any, at: str,
                  base: type, want: type) -> Any:
    """A component's ``capabilities(config, options)`` with its options validated as the run will validate
    them; None when the class or its options do not resolve (each reported once, by its own check)."""
    cls = _class(kernel, registry, name, base)
    if cls is None:
        return None
    try:
        options = kernel.options(registry, name, raw, at, factory=cls)
    except OptionsError:
        return None
    field = "rollout.engine" if kind == "engine" else f"{kind}.name"
    return _declared(kind, field, name, want, lambda: cls.capabilities(config, options))


def engine_capabilities(config: RunConfig, kernel: Kernel) -> EngineCapabilities | Violation | None:
    """The selected engine's ``capabilities(config, options)`` with its validated ``rollout.options``;
    a violation when the declaration is broken (the plugin's bug); None when the engine or its options
    do not resolve (each reported once, by its own check)."""
    r = config.rollout
    return _with_options(config, kernel, "engine", "rollout_engines", r.engine, r.options, "rollout.options",
                         RolloutEngine, EngineCapabilities)


def actor_capabilities(config: RunConfig, kernel: Kernel) -> ActorCapabilities | Violation | None:
    """The selected actor's ``capabilities(config, options)`` with its validated ``actor.options``
    (None / violation as for :func:`engine_capabilities`)."""
    a = config.actor
    return _with_options(config, kernel, "actor", "actors", a.name, a.options, "actor.options", Actor,
                         ActorCapabilities)


def controller_capabilities(config: RunConfig, kernel: Kernel) -> ControllerCapabilities | Violation | None:
    """The selected rollout controller's ``capabilities(config)`` (None / violation as above)."""
    name = config.rollout.controller
    ctl = _class(kernel, "rollout_controllers", name, RolloutController)
    if ctl is None:
        return None
    return _declared("rollout controller", "rollout.controller", name, ControllerCapabilities,
                     lambda: ctl.capabilities(config))


def resolve(config: RunConfig, kernel: Kernel) -> tuple[Capabilities, list[Violation]]:
    """Every declaration at once, with the violations of the broken ones (each reported once)."""
    found = {"engine": engine_capabilities(config, kernel), "actor": actor_capabilities(config, kernel),
             "controller": controller_capabilities(config, kernel)}
    broken = [v for v in found.values() if isinstance(v, Violation)]
    return Capabilities(**{k: (None if isinstance(v, Violation) else v) for k, v in found.items()}), broken


def capabilities(config: RunConfig, kernel: Kernel) -> Capabilities:
    """:func:`resolve` without the violations (preflight reports them): what the ``Runtime`` carries."""
    return resolve(config, kernel)[0]


def declared_capabilities(config: RunConfig, kernel: Kernel | None = None) -> Capabilities:
    """:func:`capabilities` for code that holds no kernel (a plugin's report or recorder, a test):
    ``kernel`` None resolves with the default plugin set (:func:`unirl.kernel.manager.load_kernel`). A
    hook that is handed the run's kernel or ``capabilities`` uses those instead."""
    if kernel is None:
        from unirl.kernel.manager import load_kernel

        kernel = load_kernel()
    return capabilities(config, kernel)
