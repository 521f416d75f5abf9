"""The RL loop: the whole training policy, top to bottom, in the order it happens.

One step (docs/architecture.md):
  1. the driver hands over a scored batch: the controller (``rollout.controller``, ``batch`` by default)
     rolled out prompts x n and scored them (sync: now; async: while the last step trained);
  2. the actor replays pi_old (when an update needs it), KL-in-reward and DAPO's overlong penalty shape it;
  3. the estimator computes advantages, the loss modifiers reweight tokens;
  4. the loss runs, the parity gate (a hook) before every backward, then the optimizer steps;
  5. the driver publishes the new version on its schedule (the one publish path, with receipts);
  6. the evaluator, the metrics writer, the failure guard and the checkpointer, each on its own interval.
Mechanisms (engines, actors, transports, losses) are plugins chosen by name, drivers own the rollout
mode (:mod:`unirl.trainer.drivers`), and :mod:`unirl.trainer.step` is the training half of a step; this
file only decides *what happens when*. Everything that must be identical after a resume (sampling seeds,
data order, mini-batch order) is derived from (run.seed, step), never from global RNG state.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from unirl.actor.checkpoint import latest_checkpoint
from unirl.allocator import apply_allocator, release_allocator
from unirl.config import RunConfig, dump_config
from unirl.contracts import VersionLedger, stop_token_ids  # noqa: F401 - re-exported
from unirl.data.chat import response_end_id
from unirl.data.datasets import PromptCursor, load_prompts
from unirl.kernel.errors import WorkerLostError
from unirl.kernel.manager import Kernel
from unirl.mismatch.monitor import MismatchMonitor
from unirl.preflight import check
from unirl.rollout.batch import sft_samples  # noqa: F401 - re-exported
from unirl.trainer.checkpointer import Checkpointer, ServedVersion, load_state, save_state  # noqa: F401
from unirl.trainer.components import Components, build_components  # noqa: F401 - re-exported
from unirl.trainer.drivers import Publisher, make_driver
from unirl.trainer.evaluator import Evaluator, eval_score, evaluate  # noqa: F401 - re-exported
from unirl.trainer.failures import FailureGuard, NonFiniteGuard
from unirl.trainer.memory import MemoryRecorder
from unirl.trainer.phases import phase, recording
from unirl.trainer.preempt import Preemption
from unirl.trainer.report import (
    MetricsWriter,
    progress_bar,
    rewrite_metrics,
    say,
    step_status,
)
from unirl.trainer.run import Run, TrainResult, export_model  # noqa: F401 - re-exported
from unirl.trainer.run_dir import mark_started, prepare_run_dir
from unirl.trainer.run_end import close_run, curves_so_far, finish_warm_start
from unirl.trainer.step import ScoredBatch, train_on_batch  # noqa: F401 - re-exported
from unirl.trainer.trackers import TrackerSet


def train(config: RunConfig, kernel: Kernel, *, rl: bool = True) -> TrainResult:
    """Run SFT warm start (``sft.steps``) then RL (``trainer.steps``). A run stopped early is a
    preempted one (SIGTERM / SIGINT: :mod:`unirl.trainer.preempt`), resumed with ``run.resume``."""
    check(config, kernel, rl=rl)  # every violation, before anything expensive
    apply_allocator(config.run.allocator)  # retain: every step reuses the last one's pages (unirl.allocator)
    # resume or fresh (run.resume: true / auto / false), before any model: unirl.trainer.run_dir
    plan = prepare_run_dir(config, lambda text: _say(config, text))
    run_dir = plan.run_dir
    (run_dir / "config.yaml").write_text(dump_config(config))
    checkpoint, restarts = plan.checkpoint, 0
    while True:
        torch.manual_seed(config.run.seed)
        # each phase's peak memory, the trainer's and the actor's ranks' (unirl.trainer.memory)
        with recording(MemoryRecorder()) as memory:
            pending: dict[str, Any] = {}  # the load's metrics, for the first row this attempt writes
            with phase("load", pending):
                # `unirl sft` too builds the rollout controller and its engine: the warm start's data are
                # the controller's demonstrations (an agent's tool calls), exactly as `unirl train` has them
                c = build_components(config, kernel)
                memory.attach(c.actor)
            run = Run(config, kernel, c, run_dir, pending=pending, memory=memory)
            try:
                result = _train(run, rl=rl, checkpoint=checkpoint)
                result.restarts = restarts
                return result
            except WorkerLostError as exc:  # run.max_restarts: rebuild everything, resume from the last checkpoint
                if restarts >= config.run.max_restarts:
                    raise
                restarts += 1
                checkpoint = restart_point(config, run_dir, restarts, exc)
            finally:
                if not run.tracer_closed:
                    c.tracer.close()  # a crashed run keeps the trace of what it did
                c.close()  # every process of this attempt ends here (an FSDP group's placement included)
                release_allocator(config.run.allocator)  # the pages this attempt kept go back to the kernel


def restart_point(config: RunConfig, run_dir: Path, restarts: int, exc: BaseException) -> Path | None:
    """After a lost worker: log the restart and pick the newest whole checkpoint (None: start over, with
    the metrics of the lost attempt cut, so no step is logged twice)."""
    from unirl.trainer.run_dir import choose_checkpoint

    chosen = latest_checkpoint(run_dir / "checkpoints") if (run_dir / "checkpoints" / "latest").is_file() else None
    if chosen is not None:
        chosen = choose_checkpoint(config.model_copy(update={"run": config.run.model_copy(update={"resume": True})})
                                   ).checkpoint
    else:
        rewrite_metrics(run_dir, [])
    why = " | ".join(part.strip() for part in str(exc).splitlines() if part.strip())  # one line per restart
    line = (f"restart {restarts}/{config.run.max_restarts} after {type(exc).__name__}: {why}; "
            + (f"resuming from {chosen}" if chosen is not None else "no checkpoint yet: starting over"))
    with open(run_dir / "restarts.log", "a") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
    _say(config, line)
    return chosen


def _train(run: Run, *, rl: bool, checkpoint: Path | None = None) -> TrainResult:
    config, c, t = run.config, run.c, run.config.trainer
    stops = stop_token_ids(config, c.tokenizer)
    cursor, eval_prompts = load_data(run)
    result = TrainResult(run_dir=run.run_dir)
    # the run's stateful parts, by the names the checkpoint format gives them (the driver joins below)
    checkpointer = Checkpointer(c.actor, config, run.run_dir,
                                {"cursor": cursor, "version": ServedVersion(run.ledger), "history": result})
    resume_or_warm_start(run, checkpointer, cursor, result, checkpoint)
    if not rl:
        return finish_warm_start(run, result)
    run.mismatch = MismatchMonitor(config, parity_on=c.runtime.parity is not None)  # before the first publish
    publisher = Publisher(c, run.ledger, run.kernel, config, run.run_dir, run.mismatch)
    with phase("first_sync", run.pending):  # not "sync": that name is a step's phase (step_profile counts it)
        publisher.publish()  # the engine serves the actor's weights (a resume's under the version they had)
    evaluator = Evaluator(c, eval_prompts, config, stops, run.kernel)
    trackers = TrackerSet(config, run.kernel, run.run_dir, resume_step=run.start + 1 if run.resumed else None)
    writer = MetricsWriter(run.run_dir, trackers, config=config)
    first_eval(run, evaluator, writer, result)
    end = t.steps
    preemption = Preemption(config.run.preempt_grace_s, checkpoints=run.run_dir / "checkpoints")  # SIGTERM, Ctrl-C
    driver = make_driver(c, cursor, config, run.kernel, stops, publisher, start=run.start, end=end,
                         will_save=lambda done: checkpointer.should_save(done) or preemption.requested is not None)
    try:
        checkpointer.add("controller", driver)  # the controller's state as the driver holds it (a resume's too)
        rl_steps(run, driver, evaluator, writer, result, checkpointer, preemption)
    finally:
        driver.close()  # what it runs in the background stops; the components close the controller
    close_run(run, result, end, writer)
    return result


def rl_steps(run: Run, driver: Any, evaluator: Evaluator, writer: MetricsWriter, result: TrainResult,
             checkpointer: Checkpointer, preemption: Preemption) -> None:
    """Steps ``run.start`` to ``trainer.steps``, each followed by the evaluator, the metrics, the guards
    and the checkpointer on their own intervals."""
    config, end = run.config, run.config.trainer.steps
    guards = (FailureGuard(config), NonFiniteGuard(config, run.run_dir))
    with progress_bar(config, config.algorithm.estimator, end, run.start) as bar, preemption.installed():
        for step in range(run.start, end):
            metrics, done = rl_step(step, driver, run), step + 1
            if evaluator.should_eval(done):
                driver.quiesce()  # eval is read-only: it shares the engine, and pushes no weights
                metrics.update(evaluator.run(done))
            log_step(run, step, metrics, writer, result)
            bar(done, step_status(metrics))
            for guard in guards:  # trainer.max_failed_frac, algorithm.nonfinite: the curves so far, then stop
                guard.check_or_stop(done, metrics, run, on_stop=lambda: curves_so_far(run, writer, result))
            if checkpointer.should_save(done) or preemption.requested:
                driver.quiesce()  # a checkpoint never races a launch (unconsumed groups are not saved)
                with phase("checkpoint", run.pending):  # its peaks go into the next step's row
                    saved = checkpointer.save(done)
                preemption.stop_if_requested(done, saved, flush=writer.close)


def log_step(run: Run, step: int, metrics: dict[str, Any], writer: MetricsWriter, result: TrainResult) -> None:
    """The step's metrics to the plugins (``unirl_on_step_end``), metrics.jsonl and the history."""
    for key, value in run.take_pending().items():  # load / resume / checkpoint peaks since the last row
        metrics.setdefault(key, value)
    run.kernel.call("unirl_on_step_end", step=step, metrics=metrics, config=run.config)
    writer.write(metrics)
    result.history.append(metrics)
    mark_started(run.run_dir)


def rl_step(step: int, driver: Any, run: Run) -> dict[str, Any]:
    """One step: the driver's batch, trained on, then the driver's after-update (publish on schedule)."""
    batch = driver.next_batch(step)
    run.last_batch = batch.samples
    run.failure_example = batch.failure_example or run.failure_example
    try:
        metrics = train_on_batch(step, batch, run.c, run.config, run.mismatch)
    except BaseException:
        driver.quiesce_on_error()
        raise
    driver.after_update(step, metrics)
    return metrics


def load_data(run: Run) -> tuple[PromptCursor, list[Any]]:
    """The training prompts (as a seeded cursor) and the held-out ones, with one line saying what was read."""
    config, c = run.config, run.c
    train_prompts, stats = load_prompts(config, c.tokenizer, "train", c.adapter)
    eval_prompts, _ = load_prompts(config, c.tokenizer, "eval", c.adapter)
    run.say(f"data: {stats['rows']} training prompts from {stats['source']}, {len(eval_prompts)} held out"
            + "".join(f", {stats[k]} {k.replace('_', ' ')}" for k in ("rejected_overlong", "truncated")
                      if stats.get(k)))
    return PromptCursor(train_prompts, config.trainer.prompts_per_step, seed=config.run.seed), eval_prompts


def resume_or_warm_start(run: Run, checkpointer: Checkpointer, cursor: PromptCursor, result: TrainResult,
                         checkpoint: Path | None) -> None:
    """Restore ``checkpoint`` (the actor and the checkpointer's parts: cursor, version, history; the
    controller's once the driver exists), or run the SFT warm start of a fresh run."""
    config, c = run.config, run.c
    step = None
    if checkpoint is not None:
        with phase("resume", run.pending):
            step = checkpointer.load(checkpoint)
    if step is not None:
        # The fresh engine gets the checkpoint's weights under the version they had (the first publish).
        run.start, run.resumed = step, True
        # metrics.jsonl is cut back to what the checkpoint knows (steps logged after it are re-run).
        rewrite_metrics(run.run_dir, result.history)
        run.say(f"resumed from step {run.start}")
        return
    if not config.sft.steps:
        return
    sft_cursor = PromptCursor(cursor.prompts, config.sft.batch_size, seed=config.run.seed + 1)
    with progress_bar(config, "sft", config.sft.steps) as bar:
        for i in range(config.sft.steps):
            batch = sft_cursor.next_batch()  # the controller's traces: e.g. tool calls, tool turns masked
            m = c.actor.sft_step(c.controller.warm_start_samples(batch) if c.controller is not None
                                 else sft_samples(batch, c.tokenizer, response_end_id(c.tokenizer, config.data.chat_template)))
            bar(i + 1, f"loss {m['sft_loss']:.3f}")
            if i == 0:
                mark_started(run.run_dir)
    if config.algorithm.kl_coef > 0:
        c.actor.snapshot_reference()  # the KL reference is the warm-started policy


def first_eval(run: Run, evaluator: Evaluator, writer: MetricsWriter, result: TrainResult) -> None:
    """The held-out score before RL (step 0), once per run: a resume reads it from the history."""
    if run.resumed:
        result.eval_before = next((h["eval"] for h in result.history if h["step"] == 0), math.nan)
        return
    first = {"step": 0, **evaluator.run(0), **run.take_pending()}
    result.eval_before = first["eval"]
    writer.write(first)
    result.history.append(first)
    k = run.config.trainer.eval_k
    run.say(f"held-out avg@{k} before RL: {result.eval_before:.3f} (avg@{k}: the mean reward "
            f"of {k} samples per held-out prompt)")


def _say(config: RunConfig, text: str) -> None:
    say(config, text)
