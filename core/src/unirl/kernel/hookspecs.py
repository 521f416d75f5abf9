"""The UniRL hook specifications: the whole contract between the kernel and its plugins.

Every heavy capability (an engine, an actor, a loss, a reward ...) reaches a run through one of the
hooks below. A plugin is a module (found through the ``unirl.plugins`` entry-point group) that
defines functions named like these specs and decorated with :data:`hookimpl`.

Two kinds of hooks:

* **Capability hooks** return ``{name: factory}``. The kernel merges the answers of every plugin into a
  named registry and rejects a name registered twice, naming both distributions. A factory is either a
  callable or a lazy ``"package.module:attr"`` string; the string form keeps ``unirl plugins`` from
  importing torch, vLLM or Ray just to list what is there. A factory may carry a pydantic ``Config``
  attribute, the model of its options section (``rollout.options``, ``actor.options``,
  ``weight_sync.options``, ``trace.options``, ``logging.options.<name>``,
  ``algorithm.estimator_options``): the kernel validates the section against it once
  (:meth:`~unirl.kernel.manager.Kernel.build`, the same validation preflight reports) and the factory
  is called with the validated object as ``options=`` (None when it declares no ``Config``; then any
  options are refused). A factory never parses its options itself.
* **Lifecycle hooks** are called at fixed points of a run, with keyword arguments only (pluggy passes
  arguments by name, so a plugin may accept any subset of them).

Hooks are kept few on purpose: a hook is added only when a plugin needs it.

Order: :meth:`unirl.kernel.manager.Kernel.walk` is the one walk every hook call uses: ``tryfirst``
implementations, then plain ones, then ``trylast`` ones, each band in registration order (core
first). A wrapper (``wrapper=True`` / ``hookwrapper=True``) is refused at registration with a
:class:`~unirl.kernel.errors.PluginError` naming the plugin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # types only: the kernel imports nothing of config, contracts or samples at run time
    from unirl.config import RunConfig
    from unirl.contracts import BackwardContext, Capabilities, ModelAdapter, Receipt
    from unirl.kernel.manager import Kernel
    from unirl.samples import Sample

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

    A factory is a :class:`unirl.contracts.RolloutEngine` subclass, called as ``factory(config=RunConfig,
    adapter=ModelAdapter, tokenizer=..., runtime=unirl.runtime.Runtime, options=Config | None)``
    (``runtime`` always given; ``options``: ``rollout.options`` validated against its ``Config``);
    preflight reads its ``capabilities(config, options)`` with the same validated options.
    Example: ``{"vllm": "unirl_vllm.engine:VLLMEngine"}``.
    """


@hookspec
def unirl_actors() -> Factories:
    """Train backends (actors), selected by ``actor.name``: :class:`unirl.contracts.Actor` subclasses,
    called as ``factory(config=, adapter=, tokenizer=, runtime=, options=)`` (``options``: ``actor.options``
    validated against ``Config``, None without one)."""


@hookspec
def unirl_weight_syncs() -> Factories:
    """Weight-sync transports, selected by ``weight_sync.name``.

    A transport moves an actor's weights into an engine and returns one receipt per engine worker; the
    trainer advances the version ledger only when every receipt agrees (see
    :class:`unirl.contracts.WeightSync`). Built as ``factory(config=RunConfig, options=Config | None)``
    (``weight_sync.options`` validated against its ``Config``).
    """


@hookspec
def unirl_advantage_estimators() -> Factories:
    """Advantage estimators (``grpo``, ``rloo``, ``gae`` ...), selected by ``algorithm.estimator``."""


@hookspec
def unirl_policy_losses() -> Factories:
    """Policy losses, selected by ``algorithm.loss`` (``ppo_clip`` is built in).

    A loss is called exactly like :func:`unirl.algorithms.losses.ppo_clip`:
    ``fn(inp: LossInputs, settings: LossSettings) -> (loss, metrics)``. ``inp`` is the micro-batch (flat
    tensors, the step's global denominators, reference log-probs and modifier weights when there are
    any); ``settings`` is the run's frozen :class:`unirl.api.LossSettings` (clip range, aggregation, KL
    coefficient / estimator / clamp), built once from ``algorithm``. The loss returns the micro-batch's
    sum-form loss with the global denominators, so every actor (embedded or FSDP) can use it unchanged.
    A loss with settings of its own declares a pydantic ``Config`` attribute: ``algorithm.loss_options``
    is validated against it in preflight, and the loss reads it as ``settings.options_as(Config)``.
    Preflight rejects a loss that cannot be called with these two arguments. Max-type metrics are
    declared in ``fn.metric_reduce`` (see :func:`unirl.algorithms.losses.metric_reduce_of`).
    """


@hookspec
def unirl_loss_modifiers() -> Factories:
    """Policy-loss modifiers, listed in ``algorithm.modifiers`` (applied in that order).

    A modifier is called once per trainer step, in the trainer's process, as
    ``modifier(samples, batch, config) -> dict[str, float] | None`` after advantages and pi_old are
    known and before any mini-batch is trained. ``batch`` maps names to per-sample token tensors
    (``advantages``, ``old_logprobs``, ``rollout_logprobs`` ...); the modifier may set or reweight
    ``batch["token_weights"]`` (detached, one tensor per sample), which the policy loss multiplies
    per token with the step's reduction denominators unchanged. The returned metrics are logged with
    the step. Importance-sampling rollout correction is one.
    """


@hookspec
def unirl_rewards() -> Factories:
    """Rewards, selected by ``reward.name`` (and listed in ``reward.terms``). A factory is either a
    per-sample function ``fn(completion: str, sample) -> float``, or a :class:`unirl.contracts.BatchReward`
    subclass, built once per run as ``factory(config=RunConfig, kernel=Kernel)`` and scored with one
    ``score_batch(completions, samples)`` call per rollout batch (model-based rewards: ``judge``,
    ``reward_model``). A reward that raises or returns NaN fails that sample, never a miss."""


@hookspec
def unirl_environments() -> Factories:
    """Multi-turn environments, selected by ``rollout.environment`` (see :class:`unirl.contracts.Environment`).

    A factory is called as ``factory(config=RunConfig, tools={name: Tool}, tokenizer=...)``. Core
    checks the name in preflight; the agentic rollout controller builds it.
    """


@hookspec
def unirl_tools() -> Factories:
    """Tools an agent may call, listed in ``rollout.tools`` (see :class:`unirl.contracts.Tool`).

    A factory is called as ``factory(config=RunConfig)`` and returns a :class:`~unirl.contracts.Tool`.
    Third parties add tools by entry point like any plugin.
    """


@hookspec
def unirl_rollout_controllers() -> Factories:
    """Rollout controllers (:class:`unirl.contracts.RolloutController`), selected by ``rollout.controller``.

    A controller owns *how* a step's groups are generated (core's ``batch``, the default: one engine
    call per collect; a plugin's: multi-turn environments, partial rollout); the trainer still owns
    *when* (train, eval, weight sync, DAPO's refill rounds, the async window). Built as ``factory(config=RunConfig, engine=RolloutEngine, tokenizer=..., reward_fn=...,
    kernel=Kernel, tag=str, base_seed=int)``: one for training and one for eval (``tag="eval"``), each
    closed by the trainer at the end of the run. The kernel is passed so the controller builds its
    environment and tools from the same registries (``kernel.build("environments", ...)``).
    """


@hookspec
def unirl_parity_providers() -> Factories:
    """Parity providers (:class:`unirl.contracts.ParityProvider`), looked up by the model adapter's
    ``parity_adapter`` name; built as ``factory(config=RunConfig)``.

    When the provider says it is ``enabled()``, core enters its ``exact_context(phase)`` around every
    actor replay and training forward + backward, and engines call ``install_engine(engine)`` in the
    process that builds their model, before building it.
    """


@hookspec
def unirl_trace_exporters() -> Factories:
    """Rollout trace exporters (:class:`unirl.contracts.TraceExporter`), selected by ``trace.exporter``.

    Built as ``factory(config=RunConfig, options=Config | None)`` (``trace.options`` validated against
    its ``Config``); the trainer calls ``record(phase=, step=, version=, samples=)`` after every train and
    eval rollout and ``close()`` at the end of the run.
    """


@hookspec
def unirl_trackers() -> Factories:
    """Experiment trackers (:class:`unirl.contracts.Tracker`), listed in ``logging.trackers``.

    The one logger hook: each tracker gets ``log(metrics, step)`` for every row ``metrics.jsonl`` gets,
    ``log_artifact(path)`` for the files a run leaves (the curves PNG) and ``close()`` at the end. Built
    once per run as ``factory(config=RunConfig, run_dir=Path, params=dict[str, str], resume_step=int |
    None, options=Config | None)``: ``params`` is the flattened run config, ``git_revision`` and
    ``version/<dist>`` of every loaded plugin; ``options`` is ``logging.options[<name>]`` validated by
    the kernel against the class's ``Config``. Core registers ``tensorboard``; ``unirl-trackers``
    registers ``wandb`` and ``mlflow``. The trainer wraps every call: a tracker that raises is reported
    once, counted, and never stops training.
    """


@hookspec
def unirl_model_adapters() -> Factories:
    """Model adapters, selected by ``model.adapter``.

    An adapter says how to build or load a model family, tokenize, map weight names for each engine,
    and which parity adapter applies. A third-party model arrives as a plugin returning one of these.
    """


@hookspec
def unirl_commands() -> Factories:
    """Extra ``unirl`` subcommands, e.g. ``{"parity": "unirl_parity_vllm.report:main"}``.

    ``unirl NAME ARGS...`` (a name that is not a built-in command) calls ``factory(ARGS)`` with the
    remaining arguments as a list of strings; its return value is the exit status (None is 0). The
    core CLI resolves the lazy string only when that command is run, so listing or running other
    commands imports nothing of the plugin's. A :class:`~unirl.kernel.errors.UniRLError` it raises
    prints as one message (exit 2), like the built-in commands.
    """


@hookspec
def unirl_config_sections() -> Factories:
    """The ``plugins.<name>`` sections of a run config this plugin reads, e.g.
    ``{"agentic": "unirl_agentic.options:AgenticOptions"}``: the section's name, and the pydantic model
    that validates it (the plugin validates it in its own ``unirl_preflight`` through
    ``unirl.api.section_options``, the kernel's options validation, and reads the typed model with
    ``unirl.api.plugin_section``).

    Why declared: ``plugins`` is free-form (core cannot know a plugin's keys), so a misspelt section name
    (``plugins.agentc``) used to be accepted and ignored. Preflight refuses a ``plugins.<name>`` that no
    loaded plugin declares, with the closest declared name. A section read by several plugins is declared
    once, by the plugin that owns its model (two declarations of one name are an error, as for every
    registry).
    """


@hookspec
def unirl_declarations() -> Factories:
    """A component's declarations without its implementation, keyed ``"<kind>.<name>"``, e.g.
    ``{"actors.fsdp": "unirl_fsdp.declaration:FSDPDeclaration"}``: a light class (no torch, no engine
    import) that the component's class inherits, carrying its ``Config``, ``capabilities`` and
    ``memory_layout``. Optional: without one, readers load the component's own class.

    Why: ``unirl plan`` reads only these three, and an actor's module imports torch and its whole
    training stack (1.5 s of CPU, most of what the plan cost). The component's class inherits the
    declaration, so the two cannot disagree (:meth:`unirl.kernel.manager.Kernel.declaration`).
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
    "unirl_rollout_controllers",
    "unirl_parity_providers",
    "unirl_trace_exporters",
    "unirl_trackers",
    "unirl_model_adapters",
    "unirl_commands",
    "unirl_config_sections",
    "unirl_declarations",
)


def kind_of(hook_name: str) -> str:
    """``unirl_rollout_engines`` -> ``rollout_engines`` (the registry's name)."""
    return hook_name.removeprefix("unirl_")


# --------------------------------------------------------------------------------------------------
# Lifecycle hooks.
# --------------------------------------------------------------------------------------------------


@hookspec
def unirl_preflight(config: RunConfig, adapter: ModelAdapter | None, kernel: Kernel,
                    capabilities: Capabilities) -> list:
    """Check a resolved run config before anything expensive starts.

    Called once, before Ray starts or any model is built. ``adapter`` is the selected
    :class:`unirl.contracts.ModelAdapter` (None when it failed to load): read architecture facts from
    ``adapter.hf_config(config)`` rather than special-casing adapter names. ``kernel`` is the kernel
    that will build the run: read other plugins' registrations from it (``kernel.registries``), never
    from a second ``load_kernel()``, which may see another plugin set (``UNIRL_PLUGINS``, a test's
    registrations). ``capabilities`` is :class:`unirl.contracts.Capabilities`: what the selected engine,
    actor and controller declare (workers, tensor parallelism, dtypes, switches, ranks; a member is None
    when its component does not resolve), so a check reads declarations, never component names or their
    raw options. Take only the arguments you need. Return a list of
    :class:`unirl.kernel.errors.Violation` (empty when all is well). Every plugin is asked and all
    violations are reported together, so a user fixes a recipe in one pass.
    """


@hookspec
def unirl_worker_env(config: RunConfig) -> dict[str, str]:
    """Environment variables every worker process must see (Ray ``runtime_env``, spawned engines).

    The answers of all plugins are merged; two plugins setting one variable to different values is an
    error. Parity flags (``UNIRL_PARITY_ENABLE``) travel this way.
    """


@hookspec
def unirl_before_backward(ctx: BackwardContext, config: RunConfig) -> None:
    """After a micro-batch's loss is computed, before its ``backward()``; every result is discarded.

    :Called by: the actor, on the rank that holds the micro-batch (embedded actor: the trainer's
        process; FSDP: every rank, each with its own shard, through the rebuilt kernel).
    :ctx: :class:`unirl.contracts.BackwardContext`: rl step, update, micro-batch index, rank, world
        size, the micro-batch's samples, the trainer's fp32 selected-token log-probs and the engine's
        rollout log-probs, aligned.
    :Raising: stops the step before any gradient exists (the parity gate). Collective-safe by contract:
        a multi-rank actor makes every rank raise together, so no rank is left inside a collective.
    """


@hookspec
def unirl_on_rollout(phase: str, step: int, version: int, samples: list[Sample], config: RunConfig) -> None:
    """After every rollout batch is generated and scored; results are discarded.

    :Called by: the trainer, in its process.
    :phase: "train" or "eval". For "train", ``step`` is the 0-based trainer step; for "eval" it is the
        number of steps done (0 for the pre-training eval). ``version`` is the weight version the engine served.
    :samples: the scored samples; each carries per-turn :class:`unirl.samples.RequestRecord` timing
        (submitted, first token, finished, in ms on one clock) and the engine worker id.
    """


@hookspec
def unirl_on_step_end(step: int, metrics: dict[str, Any], config: RunConfig) -> None:
    """After the optimizer step and weight sync of one trainer step; results are discarded.

    ``metrics`` is mutable: a plugin may add keys, which are logged with the step.
    """


@hookspec
def unirl_on_weights_published(version: int, receipts: list[Receipt], config: RunConfig, started_ms: float,
                               ended_ms: float) -> None:
    """After a weight sync committed ``version`` (every worker's receipt agreed); results discarded.

    ``started_ms`` / ``ended_ms`` (:func:`unirl.api.now_ms`, one clock with the request records): when the
    sync took the engine out of service (stream mode: its pause, drain included; otherwise the publish's
    start) and when it committed (the engine serves the new version from then on). A trace replays them as
    pauses in the arrival stream. An implementation declares only the arguments it reads."""
