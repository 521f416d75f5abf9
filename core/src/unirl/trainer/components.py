"""The composition root: everything a run builds once, by name, from one kernel.

Why its own module: the trainer loop, ``unirl export`` and ``unirl eval`` all build from here, and none
of them imports another to do it (export used to import the loop, and the loop imported export back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unirl.config import RunConfig
from unirl.contracts import (
    Actor,
    ModelAdapter,
    NullTracer,
    RolloutController,
    RolloutEngine,
    TraceExporter,
    WeightSync,
)
from unirl.kernel.manager import Kernel
from unirl.rewards.build import build_reward, close_reward
from unirl.runtime import Runtime, build_runtime
from unirl.samples import eval_seed


@dataclass(frozen=True)
class Components:
    """Everything a run builds once, from names in the config, with the runtime they share.

    Frozen: built once by :func:`build_components` and never reassigned, so no part of the run rewires
    another through it (a driver owns the controller it wraps; the run's own state, such as the last
    batch or the mismatch monitor, lives on the run: :class:`unirl.trainer.loop.Run`)."""

    adapter: ModelAdapter
    tokenizer: Any
    runtime: Runtime
    actor: Actor | None  # None: an eval-only set (``unirl eval``)
    engine: RolloutEngine | None
    sync: WeightSync | None
    estimator: Callable[..., Any] | None
    reward_fn: Callable[..., float]
    modifiers: list[Callable[..., dict[str, float] | None]]
    tracer: TraceExporter = field(default_factory=NullTracer)  # trace.exporter, else one that records nothing
    #: rollout.controller (``batch`` by default): drives the engine for training (``controller``) and
    #: eval (``eval_controller``); None only in a set built without rollouts (``unirl export``)
    controller: RolloutController | None = None
    eval_controller: RolloutController | None = None

    def close(self) -> None:
        for part in (self.controller, self.eval_controller, self.engine, self.actor):  # controllers first:
            if part is not None:  # they abort what they have in flight on the engine
                part.close()
        close_reward(self.reward_fn)  # a judge's engine, a reward model


def build_controllers(config: RunConfig, kernel: Kernel, engine: RolloutEngine, tokenizer: Any,
                      reward_fn: Any, *, train: bool = True) -> list[RolloutController]:
    """``rollout.controller``'s instances: the training one (``train``) and the eval one. Train and eval
    get their own (eval never sees a carried tail); the eval one draws under :func:`eval_seed`."""
    tags = [("train", config.run.seed)] if train else []
    tags.append(("eval", eval_seed(config.run.seed)))
    out: list[RolloutController] = []
    try:
        for tag, seed in tags:
            out.append(kernel.build("rollout_controllers", config.rollout.controller, config=config, engine=engine,
                                    tokenizer=tokenizer, reward_fn=reward_fn, kernel=kernel, tag=tag, base_seed=seed))
    except BaseException:
        for part in out:
            part.close()
        raise
    return out


def build_engine(config: RunConfig, kernel: Kernel, *, adapter: ModelAdapter, tokenizer: Any,
                 runtime: Runtime, **kwargs: Any) -> RolloutEngine:
    """``rollout.engine`` built with its ``rollout.options`` (validated by the kernel, once)."""
    return kernel.build("rollout_engines", config.rollout.engine, options=config.rollout.options,
                        options_at="rollout.options", config=config, adapter=adapter, tokenizer=tokenizer,
                        runtime=runtime, **kwargs)


def build_components(config: RunConfig, kernel: Kernel, *, rollouts: bool = True) -> Components:
    """Build the run's components by name, all from this one kernel. Without ``rollouts`` (``unirl
    export``) no engine is started. Every component gets the same :class:`Runtime`
    (resolved loss, hooks, worker env, parity), so nothing builds a kernel of its own."""
    adapter = kernel.build("model_adapters", config.model.adapter)
    tokenizer = adapter.build_tokenizer(config)
    runtime = build_runtime(config, kernel, adapter=adapter)
    parts = dict(config=config, adapter=adapter, tokenizer=tokenizer, runtime=runtime)
    actor = kernel.build("actors", config.actor.name, options=config.actor.options, options_at="actor.options",
                         **parts)
    engine = sync = None
    tracer: TraceExporter = NullTracer()
    controllers: list[RolloutController] = []
    reward_fn = None
    try:
        actor.set_before_backward(runtime.before_backward())
        reward_fn = build_reward(config, kernel) if rollouts else None  # a judge starts its engine here
        if rollouts:
            engine = build_engine(config, kernel, adapter=adapter, tokenizer=tokenizer, runtime=runtime)
            sync = kernel.build("weight_syncs", config.weight_sync.name, options=config.weight_sync.options,
                                options_at="weight_sync.options", config=config)
            if config.trace.exporter:
                tracer = kernel.build("trace_exporters", config.trace.exporter, options=config.trace.options,
                                      options_at="trace.options", config=config)
            controllers = build_controllers(config, kernel, engine, tokenizer, reward_fn)
    except BaseException:
        for part in (*controllers, engine, actor):
            if part is not None:
                part.close()
        close_reward(reward_fn)
        raise
    return Components(
        adapter=adapter, tokenizer=tokenizer, runtime=runtime, actor=actor, engine=engine, sync=sync,
        estimator=kernel.get("advantage_estimators", config.algorithm.estimator).load(),
        reward_fn=reward_fn,
        modifiers=[kernel.get("loss_modifiers", m).load() for m in config.algorithm.modifiers],
        tracer=tracer,
        controller=controllers[0] if controllers else None,
        eval_controller=controllers[1] if controllers else None,
    )


def build_eval_components(config: RunConfig, kernel: Kernel, adapter: ModelAdapter, tokenizer: Any) -> Components:
    """What ``unirl eval`` needs, and only that: the reward, the rollout engine (serving ``model.path``)
    and the recipe's eval controller, so a recipe is evaluated exactly as its in-training eval is (an
    agentic one multi-turn, with its tools). No actor, no optimizer, no weight sync."""
    runtime = build_runtime(config, kernel, adapter=adapter)
    reward_fn = build_reward(config, kernel)
    engine = None
    controllers: list[RolloutController] = []
    try:
        engine = build_engine(config, kernel, adapter=adapter, tokenizer=tokenizer, runtime=runtime)
        controllers = build_controllers(config, kernel, engine, tokenizer, reward_fn, train=False)
    except BaseException:
        if engine is not None:
            engine.close()
        close_reward(reward_fn)
        raise
    return Components(adapter=adapter, tokenizer=tokenizer, runtime=runtime, actor=None, engine=engine, sync=None,
                      estimator=None, reward_fn=reward_fn, modifiers=[],
                      eval_controller=controllers[0])
