"""Rollout drivers: where a step's scored batch comes from, and when the new weights go out.

The loop asks a driver three things, the same way in every mode (``rollout.mode``) and for every
controller (``rollout.controller``: core's ``batch`` or a plugin's): ``next_batch(step)`` (a
:class:`ScoredBatch`), ``after_update(step, metrics)`` (publish on schedule, plus the driver's metrics)
and ``quiesce()`` (nothing in flight: before an eval or a checkpoint). :func:`make_driver` is the one
place a mode is chosen.

* :class:`SyncDriver`: collect, train, publish, every step (DAPO: refill rounds of the same collect);
* :class:`AsyncDriver`: the next step's collect runs on the controller's thread while this one trains,
  within the on-policy window (:func:`unirl.rollout.controller.launch_ceiling`);
* :class:`~unirl.trainer.stream_driver.StreamDriver`: one-group launches keep the engine busy, a step
  takes whole groups as they finish (``rollout.mode: stream``).

A driver owns the controller it drives (async and stream wrap the recipe's in one of their own, which
nothing else sees): the checkpointer gets the controller's state through the driver's ``state_dict()``,
and ``close()`` stops what the driver runs in the background before the components close the recipe's.

Weights move through :class:`Publisher`, the one place ``unirl_on_weights_published`` fires.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from unirl.algorithms.shaping import fill_groups
from unirl.config import RunConfig
from unirl.contracts import Receipt, RolloutController, RolloutEngine, SamplingParams, VersionLedger
from unirl.data.datasets import PromptCursor
from unirl.kernel.manager import Kernel
from unirl.mismatch.monitor import MismatchMonitor
from unirl.rollout.controller import PrefetchingController, publish_next
from unirl.rollout.stall import watched
from unirl.samples import Sample, now_ms
from unirl.trainer.components import Components
from unirl.trainer.phases import phase
from unirl.trainer.rollouts import first_error, mean_reward, observe_rollout
from unirl.trainer.step import ScoredBatch
from unirl.trainer.stream_driver import StreamDriver


class Publisher:
    """The one publish path: the next version to the engine, committed only when every receipt agrees,
    then the ``unirl_on_weights_published`` hook and one line in ``RUN_DIR/weights.log``."""

    def __init__(self, c: Components, ledger: VersionLedger, kernel: Kernel, config: RunConfig,
                 run_dir: Path | None, mismatch: MismatchMonitor | None = None) -> None:
        self.c, self.ledger, self.kernel, self.config, self.mismatch = c, ledger, kernel, config, mismatch
        self.log = run_dir / "weights.log" if run_dir is not None else None

    def publish(self) -> tuple[int, list[Receipt]]:
        """Sync mode: the engine is quiet here (every rollout was reaped before)."""
        return publish_next(self.ledger, self.c.sync, self.c.actor, self.c.engine, self.published)

    def published(self, version: int, receipts: list[Receipt], lag_s: float, started_ms: float) -> None:
        """Called by :func:`unirl.rollout.controller.publish_next` once per committed version."""
        self.kernel.call("unirl_on_weights_published", version=version, receipts=receipts, config=self.config,
                         started_ms=started_ms, ended_ms=now_ms())
        if self.mismatch is not None:  # the actor keeps this version's weights if the diagnostics need them
            self.mismatch.published(version, self.c.actor)
        if self.log is not None:
            prints = sorted({r.fingerprint[:12] for r in receipts})
            with open(self.log, "a") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} version {version}: {len(receipts)} receipt(s) "
                        f"from worker(s) {sorted(r.worker for r in receipts)}, fingerprint {','.join(prints)}, "
                        f"via {','.join(sorted({r.transport for r in receipts}))}, publish {lag_s:.3f} s\n")


def train_collect(controller: RolloutController, engine: RolloutEngine, cursor: PromptCursor, config: RunConfig,
                  sampling: SamplingParams, launch_tag: str) -> list[Sample]:
    """One collect of ``prompts_per_step`` groups by the training controller, drawing from the cursor, under
    ``rollout.stall_timeout_s`` (:func:`unirl.rollout.stall.watched`: a hung engine fails the step fast)."""
    def collect() -> list[Sample]:
        return controller.collect(lambda k: cursor.next(min(k, len(cursor.prompts))),
                                  groups=config.trainer.prompts_per_step, n=config.rollout.n, sampling=sampling,
                                  launch_tag=launch_tag)
    return watched(collect, engine=engine, engine_name=config.rollout.engine,
                   timeout_s=config.rollout.stall_timeout_s, launch=launch_tag)


def collect_batch(step: int, cursor: PromptCursor, c: Components, config: RunConfig, kernel: Kernel,
                  sampling: SamplingParams) -> ScoredBatch:
    """Sync mode's half of a step: the controller's collect, and DAPO's refill rounds on top when
    ``algorithm.dynamic_sampling`` is on (policy, so it works over any controller)."""
    rounds: list[list[Sample]] = []

    def draw(k: int) -> list[Sample]:  # round k of this step, scored; launch tags stay unique per round
        version = c.engine.weight_version
        tag = f"train-{step}" if k == 0 else f"train-{step}.{k}"
        rounds.append(train_collect(c.controller, c.engine, cursor, config, sampling, tag))
        observe_rollout(c, rounds[-1], config, kernel, phase="train", step=step, version=version)
        return rounds[-1]

    ds, shaping, timings = config.algorithm.dynamic_sampling, {}, {}
    with phase("rollout", timings):
        if ds.enabled:  # DAPO: keep only groups whose rewards differ, draw more if short
            filled = fill_groups(draw, target=config.trainer.prompts_per_step, max_draws=ds.max_draws,
                                 layer=config.algorithm.group_layer)
            samples, shaping = filled.samples, filled.metrics
        else:
            samples = draw(0)
    rolled = [s for r in rounds for s in r]
    return ScoredBatch(samples, task_reward=mean_reward(rounds[0]), failed=sum(s.failed for s in rolled),
                       rolled=len(rolled), rollout_tokens=sum(len(s.response_ids) for s in rolled),
                       timings=timings,
                       shaping={**shaping, **c.controller.metrics()},
                       failure_example=next((e for e in map(first_error, reversed(rounds)) if e), None))


class SyncDriver:
    """``rollout.mode: sync``: collect (and score) a batch, train on it, publish; nothing overlaps."""

    def __init__(self, c: Components, cursor: PromptCursor, config: RunConfig, kernel: Kernel, stops: list[int],
                 publisher: Publisher) -> None:
        self.c, self.cursor, self.config, self.kernel = c, cursor, config, kernel
        self.publisher, self.sampling = publisher, SamplingParams.from_config(config, stops)

    def next_batch(self, step: int) -> ScoredBatch:
        return collect_batch(step, self.cursor, self.c, self.config, self.kernel, self.sampling)

    def after_update(self, step: int, metrics: dict[str, Any]) -> None:
        with phase("sync", metrics):
            self.publisher.publish()
        metrics["version"] = self.publisher.ledger.version

    def quiesce(self) -> None:
        """Nothing is ever in flight between steps."""

    def quiesce_on_error(self) -> None:
        """Nothing runs in the background."""

    def state_dict(self) -> dict[str, Any]:
        """The recipe's controller's state (e.g. a partial rollout's carried tail; batch's is {})."""
        return self.c.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.c.controller.load_state_dict(state)

    def close(self) -> None:
        """Nothing of its own to stop: the components close the controller."""


class AsyncDriver:
    """``rollout.mode: async``, for every controller: take this step's batch (collected while the last
    step trained), start the next step's collect in the background when the on-policy window and the
    checkpoint schedule allow it (a prefetched batch's prompts left the cursor, so none is launched
    across a scheduled checkpoint), train, and sync every ``rollout.weight_sync_interval`` steps."""

    def __init__(self, c: Components, cursor: PromptCursor, config: RunConfig, kernel: Kernel, stops: list[int],
                 publisher: Publisher, *, end: int, first_step: int, will_save: Callable[[int], bool]) -> None:
        self.c, self.cursor, self.config, self.kernel = c, cursor, config, kernel
        self.publisher, self.end, self.will_save = publisher, end, will_save
        self.sampling = SamplingParams.from_config(config, stops)
        r = config.rollout
        # the recipe's controller, wrapped: the driver's own (its state_dict holds a prefetched batch)
        self.ctrl = PrefetchingController(
            c.controller, c.engine, publisher.ledger, max_staleness=r.max_staleness,
            weight_sync_interval=r.weight_sync_interval, first_gen=first_step, on_published=publisher.published)
        self._wall0 = self._t0 = self._waited_s = 0.0
        self._staleness: list[int] = [0]

    def _collect(self, step: int) -> list[Sample]:  # on the controller thread; the trainer touches the cursor
        # only while nothing is in flight (quiesced)
        return train_collect(self.ctrl.inner, self.c.engine, self.cursor, self.config, self.sampling, f"train-{step}")

    def next_batch(self, step: int) -> ScoredBatch:
        self._wall0, self._t0 = time.time(), time.perf_counter()
        samples, staleness, waited_s, version = self.ctrl.next_batch(step, partial(self._collect, step))
        observe_rollout(self.c, samples, self.config, self.kernel, phase="train", step=step, version=version)
        done = step + 1  # the driver's policy: the window, the end, the checkpoint schedule
        if done < min(self.end, self.ctrl.launch_ceiling()) and not self.will_save(done):
            self.ctrl.launch(done, partial(self._collect, done))  # overlaps the training of this batch
        self._waited_s, self._staleness = waited_s, staleness
        return ScoredBatch.of(samples, {"rollout_s": waited_s}, self.ctrl.metrics())

    def after_update(self, step: int, metrics: dict[str, Any]) -> None:
        waited = 0.0
        with phase("sync", metrics):
            if (step + 1 - self.ctrl.first_gen) % self.config.rollout.weight_sync_interval == 0 or step + 1 == self.end:
                t1 = time.perf_counter()
                waited = self.ctrl.quiesce()  # nothing may be in flight when the version moves
                self.ctrl.sync_weights(self.c.sync, self.c.actor)
                metrics["publish_lag_s"] = time.perf_counter() - t1  # train step done -> new weights serve
        metrics["version"] = self.ctrl.ledger.version
        wall = time.perf_counter() - self._t0
        metrics.update({
            "staleness_mean": sum(self._staleness) / max(len(self._staleness), 1),
            "staleness_max": max(self._staleness, default=0),
            "trainer_idle_frac": (self._waited_s + waited) / wall if wall > 0 else 0.0,
            "engine_idle_frac": self.ctrl.engine_idle_fraction(self._wall0, time.time()),
            "inflight_launches": self.ctrl.in_flight,
        })

    def quiesce(self) -> None:
        self.ctrl.quiesce()

    def quiesce_on_error(self) -> None:
        self.ctrl.quiesce()  # the background collect ends before anything is closed

    def state_dict(self) -> dict[str, Any]:
        """The wrapper's state: the recipe's controller's, plus a prefetched batch a preemption left."""
        return self.ctrl.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ctrl.load_state_dict(state)

    def close(self) -> None:
        """The background collect ends and its thread stops; the recipe's controller stays open (the
        components close it)."""
        self.ctrl.stop()


def make_driver(c: Components, cursor: PromptCursor, config: RunConfig, kernel: Kernel, stops: list[int],
                publisher: Publisher, *, start: int, end: int,
                will_save: Callable[[int], bool]) -> SyncDriver | AsyncDriver | StreamDriver:
    """The driver of ``rollout.mode``; after the initial publish, so an async driver's window starts at
    the served version. A resumed run's controller state reaches it through the checkpointer
    (:meth:`unirl.trainer.checkpointer.Checkpointer.add`), into the controller as the driver holds it."""
    if config.rollout.mode == "sync":
        driver: SyncDriver | AsyncDriver | StreamDriver = SyncDriver(c, cursor, config, kernel, stops, publisher)
    elif config.rollout.mode == "stream":
        driver = StreamDriver(c, cursor, config, kernel, stops, publisher, end=end, first_step=start)
    else:
        driver = AsyncDriver(c, cursor, config, kernel, stops, publisher, end=end, first_step=start,
                             will_save=will_save)
    return driver
