"""The synchronous RL loop: the whole training policy, readable top to bottom.

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

from unirl.actor.checkpoint import clean_checkpoint_root, prune_checkpoints
from unirl.algorithms.shaping import apply_kl_in_reward, apply_overlong_penalty, fill_groups
from unirl.config import RunConfig, dump_config
from unirl.contracts import (
    Actor,
    ModelAdapter,
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
from unirl.rewards.builtin import score
from unirl.runtime import Runtime, build_runtime
from unirl.samples import Sample, chunks, expand
from unirl.trainer.report import MetricsWriter, plot_curves, progress_bar, rewrite_metrics


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

    def close(self) -> None:
        for part in (self.engine, self.actor):
            if part is not None:
                part.close()


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
    try:
        actor.set_before_backward(runtime.before_backward())
        if rollouts:
            engine = kernel.build("rollout_engines", config.rollout.engine, **parts)
            sync = kernel.build("weight_syncs", config.weight_sync.name, config=config)
            if config.trace.exporter:
                tracer = kernel.build("trace_exporters", config.trace.exporter, config=config)
    except BaseException:
        for part in (engine, actor):
            if part is not None:
                part.close()
        raise
    return Components(
        adapter=adapter, tokenizer=tokenizer, runtime=runtime, actor=actor, engine=engine, sync=sync,
        estimator=kernel.get("advantage_estimators", config.algorithm.estimator).load(),
        reward_fn=kernel.get("rewards", config.reward.name).load(),
        modifiers=[kernel.get("loss_modifiers", m).load() for m in config.algorithm.modifiers],
        tracer=tracer,
    )


def stop_token_ids(config: RunConfig, tokenizer: Any) -> list[int]:
    ids = [tokenizer.eos_token_id]
    for i, text in enumerate(config.rollout.stop):
        enc = tokenizer.encode(text, add_special_tokens=False)
        if len(enc) != 1:
            raise ConfigError(f"rollout.stop[{i}]: {text!r} is {len(enc)} tokens; stop strings must be one token")
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
    for s in samples:
        s.validate(source=f"rollout engine '{config.rollout.engine}'")
    stats = score(samples, c.reward_fn)
    kernel.call("unirl_on_rollout", phase=phase, step=step, version=version, samples=samples, config=config)
    if c.tracer is not None:
        c.tracer.record(phase=phase, step=step, version=version, samples=samples)
    return stats


def evaluate(c: Components, prompts: list[Sample], config: RunConfig, stops: list[int], kernel: Kernel,
             step: int) -> float:
    """avg@k on held-out prompts: mean reward over k samples per prompt, the same seeds every time."""
    slots = expand(prompts, config.trainer.eval_k, tag=f"eval-{step}", seed_tag="eval",
                   base_seed=config.run.seed + 7919)
    sampling = SamplingParams.from_config(config, stops, temperature=config.trainer.eval_temperature)
    rollout(c, slots, sampling, config, kernel, phase="eval", step=step)
    return mean_reward(slots)


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


def rl_step(step: int, cursor: PromptCursor, c: Components, config: RunConfig, kernel: Kernel,
            stops: list[int]) -> dict[str, Any]:
    a, timings, shaping = config.algorithm, {}, {}
    t0 = time.perf_counter()
    sampling = SamplingParams.from_config(config, stops)
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
    task_reward = mean_reward(rounds[0])  # the policy's task reward: first round, before filtering and shaping
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
    batch["old_logprobs"] = c.actor.logprobs(samples) if a.old_logp_source == "replay" else rollout_logp
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

    # updates_per_batch optimizer steps over disjoint mini-batches; pi_old stays frozen at the batch start.
    t0 = time.perf_counter()
    order = list(range(len(samples)))
    random.Random(config.run.seed * 1_000_003 + step).shuffle(order)
    size = math.ceil(len(samples) / a.updates_per_batch)
    train_metrics: list[dict[str, float]] = []
    # The parity gate (and any other unirl_before_backward hook) runs inside, on every micro-batch.
    for update, idx in enumerate(chunks(order, size)):
        mb = [samples[i] for i in idx]
        mb_batch = {k: [v[i] for i in idx] for k, v in batch.items()}
        train_metrics.append(c.actor.train_step(mb, mb_batch, StepInfo(rl_step=step, update=update)))
    timings["train_s"] = time.perf_counter() - t0

    metrics: dict[str, Any] = {
        "step": step + 1,
        "reward": task_reward,
        "failed": failed,
        "response_len": sum(len(s.response_ids) for s in samples) / len(samples),
        "truncated": sum(s.status == "truncated" for s in samples) / len(samples),
        "rollout_tokens": sum(len(s.response_ids) for r in rounds for s in r),
        **{k: sum(m[k] for m in train_metrics) / len(train_metrics) for k in train_metrics[0]},
        **adv.metrics,
        **shaping,
        **modifier_metrics,
        **timings,
    }
    if a.old_logp_source == "replay":  # how far the engine's numerics are from the trainer's
        diffs = [(o - r).abs().max().item() for o, r in zip(batch["old_logprobs"], rollout_logp, strict=True) if len(r)]
        metrics["rollout_replay_max_diff"] = max(diffs, default=0.0)
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
    c.actor.save(str(ckpt), extra=state)  # returns once committed and `latest` names it
    prune_checkpoints(run_dir / "checkpoints", keep_last=keep_last, keep_every=keep_every)
    return ckpt


def load_state(c: Components, run_dir: Path) -> dict[str, Any] | None:
    """The trainer state of the latest checkpoint (restoring the actor), or None for a fresh run."""
    root = run_dir / "checkpoints"
    if not (root / "latest").is_file():
        return None
    clean_checkpoint_root(root)  # a crash mid-save / mid-prune left leftovers: finish or drop them
    return c.actor.load(str(root))


# ---------------------------------------------------------------------------------------- train


def train(config: RunConfig, kernel: Kernel, *, rl: bool = True, stop_after: int | None = None) -> TrainResult:
    """Run SFT warm start (``sft.steps``) then RL (``trainer.steps``). ``stop_after`` ends the process's
    work after that many RL steps (tests use it to simulate a kill; the checkpoint stays)."""
    check(config, kernel)  # every violation, before anything expensive
    run_dir = config.run_dir
    if not config.run.resume and run_dir.is_dir() and any(run_dir.iterdir()):
        # A fresh run never mixes with (or deletes) an earlier one: the old directory is kept, renamed.
        kept = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(kept)
        _say(config, f"kept the previous run in {kept} (set run.resume=true to continue it instead)")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))
    torch.manual_seed(config.run.seed)
    c = build_components(config, kernel, rollouts=rl)
    try:
        return _train(config, kernel, c, run_dir, rl=rl, stop_after=stop_after)
    finally:
        if c.tracer is not None and not c.tracer_closed:
            c.tracer.close()  # a crashed run keeps the trace of what it did
        c.close()


def _train(config: RunConfig, kernel: Kernel, c: Components, run_dir: Path, *, rl: bool,
           stop_after: int | None) -> TrainResult:
    t = config.trainer
    stops = stop_token_ids(config, c.tokenizer)
    train_prompts, data_stats = load_prompts(config, c.tokenizer, "train")
    eval_prompts, _ = load_prompts(config, c.tokenizer, "eval")
    _say(config, f"data: {data_stats}")
    cursor = PromptCursor(train_prompts, t.prompts_per_step, seed=config.run.seed)
    ledger = VersionLedger()
    result = TrainResult(run_dir=run_dir)
    start = 0

    state = load_state(c, run_dir) if config.run.resume else None
    if state is not None:
        # The fresh engine gets the checkpoint's weights under the version they had (the publish below).
        start, ledger.version = state["step"], state["version"] - 1
        cursor.load_state_dict(state["cursor"])
        result.history = state["history"]
        # metrics.jsonl is cut back to what the checkpoint knows (steps logged after it are re-run).
        rewrite_metrics(run_dir, result.history)
        _say(config, f"resumed from step {start}")
    elif config.sft.steps:
        sft_cursor = PromptCursor(train_prompts, config.sft.batch_size, seed=config.run.seed + 1)
        with progress_bar(config, "sft", config.sft.steps) as bar:
            for i in range(config.sft.steps):
                m = c.actor.sft_step(sft_samples(sft_cursor.next_batch(), c.tokenizer))
                bar(i + 1, f"loss {m['sft_loss']:.3f}")
        if config.algorithm.kl_coef > 0:
            c.actor.snapshot_reference()  # the KL reference is the warm-started policy
    if not rl:
        c.actor.export_hf(str(run_dir / "hf"))
        return result
    publish(c, ledger, kernel, config)
    writer = MetricsWriter(run_dir, tensorboard=t.tensorboard, purge_step=start + 1 if state is not None else None)
    if state is None:
        result.eval_before = evaluate(c, eval_prompts, config, stops, kernel, step=0)
        writer.write({"step": 0, "eval": result.eval_before})
        result.history.append({"step": 0, "eval": result.eval_before})
        _say(config, f"held-out avg@{t.eval_k} before RL: {result.eval_before:.3f}")
    else:
        result.eval_before = next((h["eval"] for h in result.history if h["step"] == 0), math.nan)

    end = t.steps if stop_after is None else min(t.steps, start + stop_after)
    with progress_bar(config, "grpo" if config.algorithm.estimator != "gae" else "ppo", t.steps, start) as bar:
        for step in range(start, end):
            metrics = rl_step(step, cursor, c, config, kernel, stops)
            t0 = time.perf_counter()
            publish(c, ledger, kernel, config)
            metrics["sync_s"], metrics["version"] = time.perf_counter() - t0, ledger.version
            done = step + 1
            if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
                metrics["eval"] = evaluate(c, eval_prompts, config, stops, kernel, step=done)
            kernel.call("unirl_on_step_end", step=step, metrics=metrics, config=config)
            writer.write(metrics)
            result.history.append(metrics)
            bar(done, f"reward {metrics['reward']:.3f}" + (f" eval {metrics['eval']:.3f}" if "eval" in metrics else ""))
            if (t.save_every and done % t.save_every == 0) or done == end:
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
    if end == t.steps:
        _say(config, f"held-out avg@{t.eval_k}: {result.eval_before:.3f} -> {result.eval_after:.3f}")
        if result.plot:
            _say(config, f"curves: {result.plot}")
        _say(config, f"run directory: {run_dir} (metrics.jsonl, checkpoints/)")
    return result


def _say(config: RunConfig, text: str) -> None:
    if config.trainer.progress:
        from rich.console import Console

        Console().print(f"[bold cyan]unirl[/] {text}")
