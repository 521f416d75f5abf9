"""The RL loop (sync, or async with ``rollout.mode: async``): the whole training policy, top to bottom.

One step (design note §3):
  1. the engine rolls out prompts x n            4. the actor replays to get pi_old, the loss runs
  2. rewards are scored                          5. the parity gate runs before backward (a hook)
  3. the estimator computes advantages           6. backward + optimizer step, 7. weight sync
Between 2 and 3 the opt-in sampling-side pieces run (algorithm.dynamic_sampling, algorithm.overlong,
kl_form: reward); their mechanisms live in unirl.algorithms.shaping.
Mechanisms (engines, actors, transports, losses) are plugins chosen by name; this file only decides
*what happens when*. Everything that must be identical after a resume (sampling seeds, data order,
mini-batch order) is derived from (run.seed, step), never from global RNG state.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from unirl.actor.checkpoint import CheckpointError, clean_checkpoint_root, prune_checkpoints
from unirl.algorithms.shaping import apply_kl_in_reward, apply_overlong_penalty, fill_groups
from unirl.config import RunConfig, dump_config
from unirl.contracts import (
    Actor,
    ModelAdapter,
    RolloutController,
    RolloutEngine,
    SamplingParams,
    StepInfo,
    TraceExporter,
    VersionLedger,
    WeightSync,
)
from unirl.data.datasets import PromptCursor, load_prompts
from unirl.kernel.errors import ConfigError
from unirl.kernel.manager import Kernel
from unirl.preflight import check
from unirl.rewards.build import build_reward, close_reward, reward_term_metrics
from unirl.rewards.builtin import score
from unirl.rollout.controller import BatchRolloutController, PrefetchingController
from unirl.rollout.pool import Launch
from unirl.runtime import Runtime, build_runtime
from unirl.samples import Sample, chunks, expand
from unirl.trainer.failures import FailureGuard
from unirl.trainer.replay import replay_later, replay_scope
from unirl.trainer.report import MetricsWriter, plot_curves, progress_bar, rewrite_metrics, step_status
from unirl.trainer.run_dir import mark_started, prepare_run_dir


@dataclass
class TrainResult:
    run_dir: Path
    eval_before: float = math.nan
    eval_after: float = math.nan
    steps_done: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    plot: Path | None = None


@dataclass
class Components:
    """Everything a run builds once, from names in the config, with the runtime they share."""

    adapter: ModelAdapter
    tokenizer: Any
    runtime: Runtime
    actor: Actor
    engine: RolloutEngine | None
    sync: WeightSync | None
    estimator: Callable[..., Any]
    reward_fn: Callable[..., float]
    modifiers: list[Callable[..., dict[str, float] | None]]
    tracer: TraceExporter | None = None
    tracer_closed: bool = False
    #: rollout.controller: drives the engine for training (``controller``) and eval (``eval_controller``)
    controller: RolloutController | None = None
    eval_controller: RolloutController | None = None
    #: the error of the latest failed training sample (trainer.max_failed_frac's stop message quotes it)
    failure_example: str | None = None

    def close(self) -> None:
        for part in (self.controller, self.eval_controller, self.engine, self.actor):  # controllers first:
            if part is not None:  # they abort what they have in flight on the engine
                part.close()
        close_reward(self.reward_fn)  # a judge's engine, a reward model


def build_components(config: RunConfig, kernel: Kernel, *, rollouts: bool = True) -> Components:
    """Build the run's components by name, all from this one kernel. Without ``rollouts`` (``unirl
    sft``) no engine is started. Every component gets the same :class:`Runtime` (resolved loss, hooks,
    worker env, parity), so nothing builds a kernel of its own."""
    adapter = kernel.build("model_adapters", config.model.adapter)
    tokenizer = adapter.build_tokenizer(config)
    runtime = build_runtime(config, kernel, adapter=adapter)
    parts = dict(config=config, adapter=adapter, tokenizer=tokenizer, runtime=runtime)
    actor = kernel.build("actors", config.actor.name, **parts)
    engine = sync = tracer = None
    controllers: list[RolloutController] = []
    reward_fn = None
    try:
        actor.set_before_backward(runtime.before_backward())
        reward_fn = build_reward(config, kernel) if rollouts else None  # a judge starts its engine here
        if rollouts:
            engine = kernel.build("rollout_engines", config.rollout.engine, **parts)
            sync = kernel.build("weight_syncs", config.weight_sync.name, config=config)
            if config.trace.exporter:
                tracer = kernel.build("trace_exporters", config.trace.exporter, config=config)
            if config.rollout.controller:  # train and eval get their own: eval never sees a carried tail
                for tag, seed in (("train", config.run.seed), ("eval", config.run.seed + 7919)):
                    controllers.append(kernel.build("rollout_controllers", config.rollout.controller,
                                                    config=config, engine=engine, tokenizer=tokenizer,
                                                    reward_fn=reward_fn, kernel=kernel, tag=tag, base_seed=seed))
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


def stop_token_ids(config: RunConfig, tokenizer: Any) -> list[int]:
    """eos plus every ``rollout.stop`` string that is one token. Longer strings end a turn as text: they
    reach the engine as ``SamplingParams.stop`` (``SamplingParams.from_config`` passes all of them)."""
    ids = [tokenizer.eos_token_id]
    for i, text in enumerate(config.rollout.stop):
        enc = tokenizer.encode(text, add_special_tokens=False)
        if not enc:
            raise ConfigError(f"rollout.stop[{i}]: {text!r} encodes to no tokens; fix: remove it or give text")
        if len(enc) == 1:
            ids.append(enc[0])
    return ids


# ------------------------------------------------------------------------------------ the pieces


def publish(c: Components, ledger: VersionLedger, kernel: Kernel, config: RunConfig) -> None:
    """Weight sync is the only way a version advances, and only when every receipt agrees.

    The engine is quiet here (this loop reaps every rollout before it syncs); an engine with requests in
    flight would refuse with ``SyncRefusedError`` and keep serving the old version."""
    version = ledger.version + 1
    receipts, manifest = c.sync.publish(c.actor, c.engine, version)
    ledger.commit(version, receipts, manifest)
    kernel.call("unirl_on_weights_published", version=version, receipts=receipts, config=config)


def rollout(c: Components, samples: list[Sample], sampling: SamplingParams, config: RunConfig,
            kernel: Kernel, *, phase: str, step: int) -> list[Sample]:
    """Generate, validate every sample the engine returned, score, and tell the plugins."""
    version = c.engine.weight_version
    c.engine.generate(samples, sampling)
    return score_rollout(c, samples, config, kernel, phase=phase, step=step, version=version)


def score_rollout(c: Components, samples: list[Sample], config: RunConfig, kernel: Kernel, *, phase: str,
                  step: int, version: int) -> dict[str, int]:
    """Validate what the engine returned, score it, and tell the plugins (sync rollouts and async reaps)."""
    for s in samples:
        s.validate(source=f"rollout engine '{config.rollout.engine}'")
    stats = score(samples, c.reward_fn)
    observe_rollout(c, samples, config, kernel, phase=phase, step=step, version=version)
    return stats


def observe_rollout(c: Components, samples: list[Sample], config: RunConfig, kernel: Kernel, *, phase: str,
                    step: int, version: int) -> None:
    """Tell the plugins and the tracer about scored samples (a controller's are scored by it)."""
    if phase == "train":
        c.failure_example = next((s.meta.get("error") for s in samples if s.failed), c.failure_example)
    kernel.call("unirl_on_rollout", phase=phase, step=step, version=version, samples=samples, config=config)
    if c.tracer is not None:
        c.tracer.record(phase=phase, step=step, version=version, samples=samples)


def evaluate(c: Components, prompts: list[Sample], config: RunConfig, stops: list[int], kernel: Kernel,
             step: int) -> float:
    """avg@k on held-out prompts: mean reward over k samples per prompt, the same seeds every time."""
    slots = expand(prompts, config.trainer.eval_k, tag=f"eval-{step}", seed_tag="eval",
                   base_seed=config.run.seed + 7919)
    sampling = SamplingParams.from_config(config, stops, temperature=config.trainer.eval_temperature)
    if c.eval_controller is not None:  # the same seeds every time: the eval controller's own base seed
        queue = [p.copy() for p in prompts]
        version = c.engine.weight_version

        def draw(k: int) -> list[Sample]:
            out, queue[:] = queue[:k], queue[k:]
            return out

        slots = c.eval_controller.collect(draw, groups=len(prompts), n=config.trainer.eval_k, sampling=sampling)
        observe_rollout(c, slots, config, kernel, phase="eval", step=step, version=version)
        return eval_score(slots, config, step)
    rollout(c, slots, sampling, config, kernel, phase="eval", step=step)
    return eval_score(slots, config, step)


def eval_score(slots: list[Sample], config: RunConfig, step: int) -> float:
    """:func:`mean_reward` of an eval, saying how many samples failed (they are not misses), and NaN when
    none was scored: an eval whose every reward failed must not read as a model scoring 0."""
    failed = [s for s in slots if s.failed]
    if failed:
        example = next((s.meta.get("error") for s in failed if s.meta.get("error")), "no error recorded")
        _say(config, f"eval at step {step}: {len(failed)} of {len(slots)} samples failed (e.g. {example}); "
                     f"avg@{config.trainer.eval_k} counts only the {len(slots) - len(failed)} scored ones")
    if len(failed) == len(slots) and slots:
        return math.nan
    return mean_reward(slots)


def eval_controller_metrics(c: Components) -> dict[str, float]:
    """The eval controller's metrics of its last collect (e.g. mean turns), prefixed ``eval_``."""
    return {} if c.eval_controller is None else {f"eval_{k}": v for k, v in c.eval_controller.metrics().items()}


def mean_reward(samples: list[Sample]) -> float:
    """Mean over the samples that were scored; failed ones (NaN) are not misses and do not count."""
    rewards = [s.reward for s in samples if not math.isnan(s.reward)]
    return sum(rewards) / max(len(rewards), 1)


def sft_samples(prompts: list[Sample], tokenizer: Any) -> list[Sample]:
    out = []
    for p in prompts:
        s = p.child(0)
        s.status = "ok"
        s.response_ids = tokenizer.encode(f" {p.answer}", add_special_tokens=False) + [tokenizer.eos_token_id]
        s.loss_mask = [1] * len(s.response_ids)
        out.append(s)
    return out


def to_tensors(values: list[list[float]]) -> list[torch.Tensor]:
    return [torch.tensor(v, dtype=torch.float32) for v in values]


@dataclass
class ScoredBatch:
    """What one training step consumes: scored samples (whole groups) and how they were collected."""

    samples: list[Sample]
    task_reward: float  # the policy's task reward: first round, before filtering and shaping
    failed: int
    rollout_tokens: int
    rolled: int = 0  # samples rolled out, every round (0: len(samples)); the failed fraction's denominator
    timings: dict[str, float] = field(default_factory=dict)
    shaping: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, samples: list[Sample], timings: dict[str, float],
           shaping: dict[str, float] | None = None) -> ScoredBatch:
        """One round of rollouts trained as they came (a controller's collect, an async reap): nothing
        filtered, so the task reward, failures and tokens are those of ``samples`` themselves."""
        return cls(samples, task_reward=mean_reward(samples), failed=sum(s.failed for s in samples),
                   rollout_tokens=sum(len(s.response_ids) for s in samples), timings=timings,
                   shaping=shaping or {})


def rl_step(step: int, cursor: PromptCursor, c: Components, config: RunConfig, kernel: Kernel,
            stops: list[int]) -> dict[str, Any]:
    """One synchronous step: roll out a batch, then train on it."""
    return train_on_batch(step, collect_batch(step, cursor, c, config, kernel, stops), c, config)


def collect_batch(step: int, cursor: PromptCursor, c: Components, config: RunConfig, kernel: Kernel,
                  stops: list[int]) -> ScoredBatch:
    """Sync mode's half of a step: generate and score prompts_per_step groups (DAPO: refill)."""
    a, timings, shaping = config.algorithm, {}, {}
    t0 = time.perf_counter()
    sampling = SamplingParams.from_config(config, stops)
    if c.controller is not None:  # rollout.controller: it draws prompts as it needs them, and scores
        version = c.engine.weight_version
        samples = c.controller.collect(lambda k: cursor.next(min(k, len(cursor.prompts))),
                                       groups=config.trainer.prompts_per_step, n=config.rollout.n, sampling=sampling)
        observe_rollout(c, samples, config, kernel, phase="train", step=step, version=version)
        timings["rollout_s"] = time.perf_counter() - t0
        return ScoredBatch.of(samples, timings, c.controller.metrics())
    rounds: list[list[Sample]] = []
    failed = 0

    def draw(k: int) -> list[Sample]:  # one rollout round of prompts_per_step prompts, scored
        nonlocal failed
        tag = f"train-{step}" if k == 0 else f"train-{step}.{k}"  # launch tags stay unique per round
        rounds.append(expand(cursor.next_batch(), config.rollout.n, tag=tag, base_seed=config.run.seed))
        failed += rollout(c, rounds[-1], sampling, config, kernel, phase="train", step=step).get("failed", 0)
        return rounds[-1]

    if a.dynamic_sampling.enabled:  # DAPO: keep only groups whose rewards differ, draw more if short
        filled = fill_groups(draw, target=config.trainer.prompts_per_step, max_draws=a.dynamic_sampling.max_draws)
        samples, shaping = filled.samples, filled.metrics
    else:
        samples = draw(0)
    timings["rollout_s"] = time.perf_counter() - t0
    return ScoredBatch(samples, task_reward=mean_reward(rounds[0]), failed=failed, rolled=sum(map(len, rounds)),
                       rollout_tokens=sum(len(s.response_ids) for r in rounds for s in r),
                       timings=timings, shaping=shaping)


def train_on_batch(step: int, scored: ScoredBatch, c: Components, config: RunConfig) -> dict[str, Any]:
    """The training half of a step, shared by sync and async: pi_old, advantages, modifiers, updates."""
    a, samples, timings, shaping = config.algorithm, scored.samples, dict(scored.timings), dict(scored.shaping)
    for s in samples:  # an infrastructure failure is not a genuine miss: it takes no part in the loss
        if s.failed:
            s.loss_mask = [0] * len(s.response_ids)
    if a.overlong.enabled:  # DAPO's soft overlong punishment, added to the reward
        shaping.update(apply_overlong_penalty(samples, max_len=config.rollout.max_new_tokens,
                                              buffer=a.overlong.buffer_tokens, penalty=a.overlong.penalty))

    t0 = time.perf_counter()
    batch: dict[str, list[torch.Tensor]] = {}
    rollout_logp = to_tensors([s.rollout_logprobs for s in samples])
    batch["rollout_logprobs"] = rollout_logp
    # updates_per_batch optimizer steps over disjoint mini-batches; pi_old stays frozen at the batch start.
    order = list(range(len(samples)))
    random.Random(config.run.seed * 1_000_003 + step).shuffle(order)
    updates = list(chunks(order, math.ceil(len(samples) / a.updates_per_batch)))
    # pi_old: the engine's log-probs, a replay, or (nothing reads pi_old before the first update) absent
    # for the first mini-batch, whose own forward is pi_old bit for bit (unirl.trainer.replay)
    scope = replay_scope(config, c.runtime, c.modifiers)
    if a.old_logp_source == "rollout":
        batch["old_logprobs"] = rollout_logp
    elif scope == "all":
        batch["old_logprobs"] = c.actor.logprobs(samples)
    elif scope == "later":  # only the mini-batches after the first; None for the first one's samples
        batch["old_logprobs"] = replay_later(c.actor, samples, updates)
    if a.kl_coef > 0:
        batch["ref_logprobs"] = c.actor.ref_logprobs(samples)
        if a.kl_form == "reward":  # the penalty goes into the rewards; the loss then carries no KL term
            shaping.update(apply_kl_in_reward(samples, batch["old_logprobs"], batch["ref_logprobs"],
                                              kl_coef=a.kl_coef, estimator=a.kl_estimator, clamp=a.kl_clamp))
    values = c.actor.values(samples) if c.runtime.estimator.needs_values else None
    adv = c.estimator(samples, options=a.estimator_options, algorithm=a, values=values)
    batch["advantages"] = adv.advantages
    if adv.returns is not None:
        batch["returns"], batch["old_values"] = adv.returns, values
    modifier_metrics: dict[str, float] = {}
    for modifier in c.modifiers:  # e.g. importance-sampling correction: reweights batch["token_weights"]
        modifier_metrics.update(modifier(samples, batch, config) or {})
    timings["replay_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    train_metrics: list[dict[str, float]] = []
    # The parity gate (and any other unirl_before_backward hook) runs inside, on every micro-batch.
    for update, idx in enumerate(updates):
        mb = [samples[i] for i in idx]
        mb_batch = {k: [v[i] for i in idx] for k, v in batch.items() if not (k == "old_logprobs" and v[idx[0]] is None)}
        train_metrics.append(c.actor.train_step(mb, mb_batch, StepInfo(rl_step=step, update=update)))
    timings["train_s"] = time.perf_counter() - t0

    metrics: dict[str, Any] = {
        "step": step + 1,
        "reward": scored.task_reward,
        "failed": scored.failed,
        "response_len": sum(len(s.response_ids) for s in samples) / len(samples),
        "truncated": sum(s.status == "truncated" for s in samples) / len(samples),
        "rollout_tokens": scored.rollout_tokens,
        **{k: sum(m[k] for m in train_metrics) / len(train_metrics) for k in train_metrics[0]
           if k != "rollout_replay_max_diff"},
        **adv.metrics,
        **shaping,
        **reward_term_metrics(samples),  # reward/<name> of each reward.terms term
        **modifier_metrics,
        **timings,
        # of every sample rolled out this step (after the estimator's own: with dynamic sampling, its
        # failed_frac counts only the kept groups)
        "failed_frac": scored.failed / (scored.rolled or len(samples)),
    }
    # engine numerics vs the trainer's: from the replay, and from a forward that stood in for it
    diffs = [m["rollout_replay_max_diff"] for m in train_metrics if "rollout_replay_max_diff" in m]
    if "old_logprobs" in batch and a.old_logp_source == "replay":
        diffs += [(o - r).abs().max().item() for o, r in zip(batch["old_logprobs"], rollout_logp, strict=True)
                  if o is not None and len(r)]
    if diffs:
        metrics["rollout_replay_max_diff"] = max(diffs)
    return metrics


# ------------------------------------------------------------------------------------- async mode
# rollout.mode: async (docs/async.md). The controller (unirl.rollout) holds the mechanism: launch-time
# stamps, the launch ceiling, complete-or-nothing reaps, quiesce-before-sync. What happens when is here.


def async_controller(c: Components, ledger: VersionLedger, config: RunConfig, kernel: Kernel,
                     first_step: int) -> BatchRolloutController | PrefetchingController:
    """The controller of an async run, after the initial publish; step ``first_step`` trains first. With
    ``rollout.controller`` it wraps the trainer's controller (which becomes ``c.controller``): the next
    step's collect runs in the background while this one trains."""
    r = config.rollout
    if c.controller is not None:
        c.controller = PrefetchingController(c.controller, c.engine, ledger, max_staleness=r.max_staleness,
                                             weight_sync_interval=r.weight_sync_interval, first_gen=first_step)
        return c.controller

    def on_complete(launch: Launch) -> None:  # runs on the trainer's thread, at reap time
        score_rollout(c, launch.samples, config, kernel, phase="train", step=launch.gen_id, version=launch.version)

    return BatchRolloutController(c.engine, ledger, engine_name=r.engine, max_staleness=r.max_staleness,
                                  weight_sync_interval=r.weight_sync_interval, first_gen=first_step,
                                  on_complete=on_complete)


def controller_async_step(step: int, end: int, ctrl: PrefetchingController, cursor: PromptCursor,
                          c: Components, config: RunConfig, kernel: Kernel, stops: list[int]) -> dict[str, Any]:
    """One async step with a rollout controller: take this step's batch (prefetched during the last
    step), start the next step's collect in the background (within the staleness ceiling, and never
    across a checkpoint: a prefetched batch's prompts left the cursor), train, and sync on schedule."""
    r, t = config.rollout, config.trainer
    wall0, t0 = time.time(), time.perf_counter()
    sampling = SamplingParams.from_config(config, stops)

    def collect() -> list[Sample]:  # on the controller's thread; the trainer touches the cursor only quiesced
        return ctrl.inner.collect(lambda k: cursor.next(min(k, len(cursor.prompts))),
                                  groups=t.prompts_per_step, n=r.n, sampling=sampling)

    samples, staleness, waited_s, version = ctrl.next_batch(step, collect)
    observe_rollout(c, samples, config, kernel, phase="train", step=step, version=version)
    done = step + 1
    if done < end and not (t.save_every and done % t.save_every == 0):
        ctrl.launch(done, collect)  # overlaps the training below
    scored = ScoredBatch.of(samples, {"rollout_s": waited_s}, ctrl.metrics())
    try:
        metrics = train_on_batch(step, scored, c, config)
    except BaseException:
        ctrl.quiesce()  # the background drive ends before anything is closed
        raise
    t1, waited = time.perf_counter(), 0.0
    if (done - ctrl.first_gen) % r.weight_sync_interval == 0 or done == end:
        waited = ctrl.quiesce()  # nothing may be in flight when the version moves
        version, receipts = ctrl.sync_weights(c.sync, c.actor)
        kernel.call("unirl_on_weights_published", version=version, receipts=receipts, config=config)
        metrics["publish_lag_s"] = time.perf_counter() - t1
    metrics["sync_s"] = time.perf_counter() - t1
    metrics["version"] = ctrl.ledger.version
    wall = time.perf_counter() - t0
    metrics.update({
        "staleness_mean": sum(staleness) / max(len(staleness), 1),
        "staleness_max": max(staleness, default=0),
        "trainer_idle_frac": (waited_s + waited) / wall if wall > 0 else 0.0,
        "engine_idle_frac": ctrl.engine_idle_fraction(wall0, time.time()),
        "inflight_launches": ctrl.in_flight,
    })
    return metrics


def async_step(step: int, end: int, ctrl: BatchRolloutController | PrefetchingController, cursor: PromptCursor,
               c: Components, config: RunConfig, kernel: Kernel, stops: list[int]) -> dict[str, Any]:
    """One async step: top up launches to the ceiling, take the freshest batch, train while the engine
    generates the next ones, and every ``weight_sync_interval`` steps quiesce and sync."""
    if isinstance(ctrl, PrefetchingController):
        return controller_async_step(step, end, ctrl, cursor, c, config, kernel, stops)
    r = config.rollout
    wall0, t0 = time.time(), time.perf_counter()
    sampling = SamplingParams.from_config(config, stops)

    def build(gen_id: int) -> tuple[list[Sample], SamplingParams]:  # launch gen_id = the batch for step gen_id
        return expand(cursor.next_batch(), r.n, tag=f"train-{gen_id}", base_seed=config.run.seed), sampling

    ctrl.launch_until(end, r.max_inflight, build)
    drained = ctrl.next_batch(config.trainer.prompts_per_step, build)
    ctrl.launch_until(end, r.max_inflight, build)  # a slot may have freed: keep the engine busy
    samples = drained.samples
    scored = ScoredBatch.of(samples, {"rollout_s": drained.waited_s})
    metrics = train_on_batch(step, scored, c, config)
    t1, waited = time.perf_counter(), 0.0
    if (step + 1 - ctrl.first_gen) % r.weight_sync_interval == 0 or step + 1 == end:
        waited = ctrl.quiesce()  # nothing may be in flight when the version moves
        version, receipts = ctrl.sync_weights(c.sync, c.actor)
        kernel.call("unirl_on_weights_published", version=version, receipts=receipts, config=config)
        metrics["publish_lag_s"] = time.perf_counter() - t1  # train step done -> new weights serve
    metrics["sync_s"] = time.perf_counter() - t1
    metrics["version"] = ctrl.ledger.version
    wall = time.perf_counter() - t0
    metrics.update({
        "staleness_mean": sum(drained.staleness) / len(drained.staleness),
        "staleness_max": max(drained.staleness),
        "evicted_groups": len(drained.evicted),
        "trainer_idle_frac": (drained.waited_s + waited) / wall if wall > 0 else 0.0,
        "engine_idle_frac": ctrl.engine_idle_fraction(wall0, time.time()),
        "inflight_launches": ctrl.pool.in_flight,
    })
    return metrics


# ----------------------------------------------------------------------------------- checkpoints


def save_state(c: Components, run_dir: Path, step: int, cursor: PromptCursor, ledger: VersionLedger,
               history: list[dict[str, Any]], *, keep_last: int = 0, keep_every: int = 0) -> Path:
    """One atomic checkpoint: the actor's state plus the trainer's (step, data cursor, version, history).

    The actor writes it to a temp dir, renames it into place and only then moves ``checkpoints/latest``,
    so a crash at any point leaves the previous checkpoint as the one a resume finds. Only then,
    retention (``trainer.keep_last`` / ``trainer.keep_every``) prunes the older ones, oldest first.
    """
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    state = {"step": step, "cursor": cursor.state_dict(), "version": ledger.version, "history": history}
    if c.controller is not None:  # e.g. a partial rollout's carried tail: its prompts left the cursor already
        state["controller"] = c.controller.state_dict()
    c.actor.save(str(ckpt), extra=state)  # returns once committed and `latest` names it
    prune_checkpoints(run_dir / "checkpoints", keep_last=keep_last, keep_every=keep_every)
    return ckpt


def export_model(c: Components, out: Path) -> None:
    """The trained policy as a plain HF directory (what ``unirl export`` writes from a checkpoint)."""
    from unirl.export import finish_hf_dir

    c.actor.export_hf(str(out))
    finish_hf_dir(out, c.tokenizer)


def load_state(c: Components, run_dir: Path, checkpoint: Path | None = None) -> dict[str, Any] | None:
    """The trainer state of ``checkpoint`` (default: the one ``latest`` names), restoring the actor; None
    for a fresh run. :func:`unirl.trainer.run_dir.prepare_run_dir` chose ``checkpoint`` (corrupt ones skipped)."""
    root = run_dir / "checkpoints"
    if checkpoint is None:
        if not (root / "latest").is_file():
            return None
        clean_checkpoint_root(root)  # a crash mid-save / mid-prune left leftovers: finish or drop them
    target = str(checkpoint or root)
    try:
        return c.actor.load(target)
    except CheckpointError:
        raise
    except Exception as exc:  # whole files that do not fit this actor (e.g. a changed model.build)
        raise CheckpointError(f"checkpoint {target} cannot be restored ({type(exc).__name__}: {exc}); fix: resume "
                              f"with the config it was trained with ({run_dir / 'config.yaml'}), or set "
                              "run.resume=false to start fresh") from exc


# ---------------------------------------------------------------------------------------- train


def train(config: RunConfig, kernel: Kernel, *, rl: bool = True, stop_after: int | None = None) -> TrainResult:
    """Run SFT warm start (``sft.steps``) then RL (``trainer.steps``). ``stop_after`` ends the process's
    work after that many RL steps (tests use it to simulate a kill; the checkpoint stays)."""
    check(config, kernel)  # every violation, before anything expensive
    # resume or fresh (run.resume: true / auto / false), before any model: unirl.trainer.run_dir
    plan = prepare_run_dir(config, lambda text: _say(config, text))
    run_dir = plan.run_dir
    (run_dir / "config.yaml").write_text(dump_config(config))
    torch.manual_seed(config.run.seed)
    c = build_components(config, kernel, rollouts=rl)
    try:
        return _train(config, kernel, c, run_dir, rl=rl, stop_after=stop_after, checkpoint=plan.checkpoint)
    finally:
        if c.tracer is not None and not c.tracer_closed:
            c.tracer.close()  # a crashed run keeps the trace of what it did
        c.close()


def _train(config: RunConfig, kernel: Kernel, c: Components, run_dir: Path, *, rl: bool,
           stop_after: int | None, checkpoint: Path | None = None) -> TrainResult:
    t, t_start = config.trainer, time.perf_counter()
    stops = stop_token_ids(config, c.tokenizer)
    train_prompts, data_stats = load_prompts(config, c.tokenizer, "train")
    eval_prompts, _ = load_prompts(config, c.tokenizer, "eval")
    _say(config, f"data: {data_stats['rows']} training prompts from {data_stats['source']}, {len(eval_prompts)} held out"
         + "".join(f", {data_stats[k]} {k.replace('_', ' ')}" for k in ("rejected_overlong", "truncated")
                   if data_stats.get(k)))
    cursor = PromptCursor(train_prompts, t.prompts_per_step, seed=config.run.seed)
    ledger = VersionLedger()
    result = TrainResult(run_dir=run_dir)
    start = 0

    state = load_state(c, run_dir, checkpoint) if checkpoint is not None else None
    if state is not None:
        # The fresh engine gets the checkpoint's weights under the version they had (the publish below).
        start, ledger.version = state["step"], state["version"] - 1
        cursor.load_state_dict(state["cursor"])
        if c.controller is not None:
            c.controller.load_state_dict(state.get("controller", {}))
        result.history = state["history"]
        # metrics.jsonl is cut back to what the checkpoint knows (steps logged after it are re-run).
        rewrite_metrics(run_dir, result.history)
        _say(config, f"resumed from step {start}")
    elif config.sft.steps:
        sft_cursor = PromptCursor(train_prompts, config.sft.batch_size, seed=config.run.seed + 1)
        with progress_bar(config, "sft", config.sft.steps) as bar:
            for i in range(config.sft.steps):
                batch = sft_cursor.next_batch()  # a controller's traces: e.g. tool calls, tool turns masked
                m = c.actor.sft_step(c.controller.warm_start_samples(batch) if c.controller is not None
                                     else sft_samples(batch, c.tokenizer))
                bar(i + 1, f"loss {m['sft_loss']:.3f}")
                if i == 0:
                    mark_started(run_dir)
        if config.algorithm.kl_coef > 0:
            c.actor.snapshot_reference()  # the KL reference is the warm-started policy
    if not rl:
        export_model(c, run_dir / "hf")
        _say(config, f"warm-started model: {run_dir / 'hf'} (transformers / vLLM load it; model.path= uses it)")
        return result
    publish(c, ledger, kernel, config)
    writer = MetricsWriter(run_dir, tensorboard=t.tensorboard, purge_step=start + 1 if state is not None else None)
    if state is None:
        result.eval_before = evaluate(c, eval_prompts, config, stops, kernel, step=0)
        first = {"step": 0, "eval": result.eval_before, **eval_controller_metrics(c)}
        writer.write(first)
        result.history.append(first)
        _say(config, f"held-out avg@{t.eval_k} before RL: {result.eval_before:.3f} (avg@{t.eval_k}: the mean reward "
                     f"of {t.eval_k} samples per held-out prompt)")
    else:
        result.eval_before = next((h["eval"] for h in result.history if h["step"] == 0), math.nan)

    end = t.steps if stop_after is None else min(t.steps, start + stop_after)
    ctrl = async_controller(c, ledger, config, kernel, start) if config.rollout.mode == "async" else None
    guard = FailureGuard(config)
    with progress_bar(config, "grpo" if config.algorithm.estimator != "gae" else "ppo", t.steps, start) as bar:
        for step in range(start, end):
            if ctrl is None:
                metrics = rl_step(step, cursor, c, config, kernel, stops)
                t0 = time.perf_counter()
                publish(c, ledger, kernel, config)
                metrics["sync_s"], metrics["version"] = time.perf_counter() - t0, ledger.version
            else:
                metrics = async_step(step, end, ctrl, cursor, c, config, kernel, stops)
            done = step + 1
            if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
                if ctrl is not None:
                    ctrl.quiesce()  # eval is read-only: it shares the engine, and pushes no weights
                metrics["eval"] = evaluate(c, eval_prompts, config, stops, kernel, step=done)
                metrics.update(eval_controller_metrics(c))
            kernel.call("unirl_on_step_end", step=step, metrics=metrics, config=config)
            writer.write(metrics)
            result.history.append(metrics)
            mark_started(run_dir)
            bar(done, step_status(metrics))
            stop = guard.check(done, metrics["failed_frac"], c.failure_example)
            if stop is not None:  # trainer.max_failed_frac: the curves so far, then the message
                writer.close()
                if t.plot:
                    plot_curves(result.history, run_dir / "curves.png")
                raise stop
            if (t.save_every and done % t.save_every == 0) or done == end:
                if ctrl is not None:
                    ctrl.quiesce()  # a checkpoint never races a launch (unconsumed groups are not saved)
                save_state(c, run_dir, done, cursor, ledger, result.history,
                           keep_last=t.keep_last, keep_every=t.keep_every)
    writer.close()
    if c.tracer is not None:
        trace, c.tracer_closed = c.tracer.close(), True
        if trace:
            _say(config, f"rollout trace: {trace}")
    result.steps_done = end
    evals = [h["eval"] for h in result.history if "eval" in h and h["step"] > 0]
    result.eval_after = evals[-1] if evals and end == t.steps else math.nan
    if t.plot:
        result.plot = plot_curves(result.history, run_dir / "curves.png")
    if end == t.steps and t.export_hf and t.steps > 0:
        export_model(c, run_dir / "hf")
    if t.steps == 0:  # nothing trained, nothing saved: say what ran and where evaluation lives
        _say(config, f"trainer.steps=0: no RL step ran; held-out avg@{t.eval_k} of this model: "
                     f"{result.eval_before:.3f}. To evaluate a model: unirl eval RECIPE model.path=DIR")
    elif end == t.steps:
        minutes, seconds = divmod(int(time.perf_counter() - t_start), 60)
        _say(config, f"held-out avg@{t.eval_k}: {result.eval_before:.3f} -> {result.eval_after:.3f} "
                     f"({minutes}m{seconds:02d}s)")
        if result.plot:
            _say(config, f"curves: {result.plot}")
        _say(config, f"run directory: {run_dir} (metrics.jsonl, checkpoints/"
                     + (", hf/: the trained model for transformers or vLLM)" if t.export_hf else ")"))
    return result


def _say(config: RunConfig, text: str) -> None:
    if config.trainer.progress:
        from rich.console import Console

        Console(soft_wrap=True).print(f"[bold cyan]unirl[/] {text}")
