"""Rollout drivers: where a step's scored batch comes from, and when the new weights go out.

The loop asks a driver three things, the same way in every mode (``rollout.mode``) and for every
controller: ``next_batch(step)`` (a :class:`ScoredBatch`), ``after_update(step, metrics)`` (publish on
schedule, plus the driver's metrics) and ``quiesce()`` (nothing in flight: before an eval or a
checkpoint). :func:`make_driver` is the one place a mode is chosen.

* :class:`SyncDriver`: roll out, train, publish, every step (plain, DAPO refill, or a controller);
* :class:`PoolDriver`: async over the engine's ``submit``: up to ``max_inflight`` batches in flight
  (:class:`unirl.rollout.controller.BatchRolloutController`);
* :class:`PrefetchDriver`: async with a controller: the next step's collect runs while this one trains
  (:class:`unirl.rollout.controller.PrefetchingController`).

Weights move through :class:`Publisher`, the one place ``unirl_on_weights_published`` fires.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unirl.algorithms.shaping import fill_groups
from unirl.config import RunConfig
from unirl.contracts import Receipt, SamplingParams, VersionLedger
from unirl.data.datasets import PromptCursor
from unirl.kernel.manager import Kernel
from unirl.rollout.buffer import BufferedGroup
from unirl.rollout.controller import (
    BatchRolloutController,
    Build,
    Drained,
    PrefetchingController,
    publish_next,
)
from unirl.rollout.pool import Launch
from unirl.samples import Sample, expand
from unirl.trainer.components import Components
from unirl.trainer.rollouts import mean_reward, observe_rollout, rollout, score_rollout
from unirl.trainer.step import ScoredBatch


class Publisher:
    """The one publish path: the next version to the engine, committed only when every receipt agrees,
    then the ``unirl_on_weights_published`` hook and one line in ``RUN_DIR/weights.log``."""

    def __init__(self, c: Components, ledger: VersionLedger, kernel: Kernel, config: RunConfig,
                 run_dir: Path | None) -> None:
        self.c, self.ledger, self.kernel, self.config = c, ledger, kernel, config
        self.log = run_dir / "weights.log" if run_dir is not None else None

    def publish(self) -> tuple[int, list[Receipt]]:
        """Sync mode: the engine is quiet here (every rollout was reaped before)."""
        return publish_next(self.ledger, self.c.sync, self.c.actor, self.c.engine, self.published)

    def published(self, version: int, receipts: list[Receipt], lag_s: float) -> None:
        """Called by :func:`unirl.rollout.controller.publish_next` once per committed version."""
        self.kernel.call("unirl_on_weights_published", version=version, receipts=receipts, config=self.config)
        if self.log is not None:
            prints = sorted({r.fingerprint[:12] for r in receipts})
            with open(self.log, "a") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} version {version}: {len(receipts)} receipt(s) "
                        f"from worker(s) {sorted(r.worker for r in receipts)}, fingerprint {','.join(prints)}, "
                        f"via {','.join(sorted({r.transport for r in receipts}))}, publish {lag_s:.3f} s\n")


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


class SyncDriver:
    """``rollout.mode: sync``: roll out (and score) a batch, train on it, publish; nothing overlaps."""

    def __init__(self, c: Components, cursor: PromptCursor, config: RunConfig, kernel: Kernel, stops: list[int],
                 publisher: Publisher) -> None:
        self.c, self.cursor, self.config, self.kernel, self.stops = c, cursor, config, kernel, stops
        self.publisher = publisher

    def next_batch(self, step: int) -> ScoredBatch:
        return collect_batch(step, self.cursor, self.c, self.config, self.kernel, self.stops)

    def after_update(self, step: int, metrics: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        self.publisher.publish()
        metrics["sync_s"], metrics["version"] = time.perf_counter() - t0, self.publisher.ledger.version

    def quiesce(self) -> None:
        """Nothing is ever in flight between steps."""

    def quiesce_on_error(self) -> None:
        """Nothing runs in the background."""


class _AsyncDriver:
    """What both async drivers share: the step's wall clock, the sync schedule
    (``rollout.weight_sync_interval`` and the last step) and the overlap metrics."""

    ctrl: BatchRolloutController | PrefetchingController

    def __init__(self, c: Components, cursor: PromptCursor, config: RunConfig, kernel: Kernel, stops: list[int],
                 publisher: Publisher, *, end: int) -> None:
        self.c, self.cursor, self.config, self.kernel, self.stops = c, cursor, config, kernel, stops
        self.publisher, self.end = publisher, end
        self.sampling = SamplingParams.from_config(config, stops)
        self._wall0 = self._t0 = 0.0
        self._waited_s, self._staleness = 0.0, [0]

    def _start(self) -> None:
        self._wall0, self._t0 = time.time(), time.perf_counter()

    def after_update(self, step: int, metrics: dict[str, Any]) -> None:
        t1, waited = time.perf_counter(), 0.0
        if (step + 1 - self.ctrl.first_gen) % self.config.rollout.weight_sync_interval == 0 or step + 1 == self.end:
            waited = self.ctrl.quiesce()  # nothing may be in flight when the version moves
            self.ctrl.sync_weights(self.c.sync, self.c.actor)
            metrics["publish_lag_s"] = time.perf_counter() - t1  # train step done -> new weights serve
        metrics["sync_s"] = time.perf_counter() - t1
        metrics["version"] = self.ctrl.ledger.version
        wall = time.perf_counter() - self._t0
        metrics.update({
            "staleness_mean": sum(self._staleness) / max(len(self._staleness), 1),
            "staleness_max": max(self._staleness, default=0),
            **self._extra_metrics(),
            "trainer_idle_frac": (self._waited_s + waited) / wall if wall > 0 else 0.0,
            "engine_idle_frac": self.ctrl.engine_idle_fraction(self._wall0, time.time()),
            "inflight_launches": self._in_flight(),
        })

    def _extra_metrics(self) -> dict[str, Any]:
        return {}

    def _in_flight(self) -> int:
        raise NotImplementedError

    def quiesce(self) -> None:
        self.ctrl.quiesce()

    def quiesce_on_error(self) -> None:
        """Nothing runs in the background past an error."""


class PoolDriver(_AsyncDriver):
    """``rollout.mode: async`` without a controller: top up launches to the ceiling, take the freshest
    batch, and let the engine generate the next ones while this one trains."""

    def __init__(self, c: Components, cursor: PromptCursor, config: RunConfig, kernel: Kernel, stops: list[int],
                 publisher: Publisher, *, end: int, first_step: int) -> None:
        super().__init__(c, cursor, config, kernel, stops, publisher, end=end)
        r = config.rollout

        def on_complete(launch: Launch) -> None:  # runs on the trainer's thread, at reap time
            score_rollout(c, launch.samples, config, kernel, phase="train", step=launch.gen_id, version=launch.version)

        self.ctrl = BatchRolloutController(c.engine, publisher.ledger, engine_name=r.engine,
                                           max_staleness=r.max_staleness, weight_sync_interval=r.weight_sync_interval,
                                           first_gen=first_step, on_complete=on_complete,
                                           on_published=publisher.published)
        self._evicted = 0

    def _build(self, gen_id: int) -> tuple[list[Sample], SamplingParams]:
        """Launch ``gen_id`` is the batch of step ``gen_id``."""
        return (expand(self.cursor.next_batch(), self.config.rollout.n, tag=f"train-{gen_id}",
                       base_seed=self.config.run.seed), self.sampling)

    def next_batch(self, step: int) -> ScoredBatch:
        self._start()
        r = self.config.rollout
        self.ctrl.launch_until(self.end, r.max_inflight, self._build)
        drained = next_drained(self.ctrl, self.config.trainer.prompts_per_step, self._build)
        self.ctrl.launch_until(self.end, r.max_inflight, self._build)  # a slot may have freed: keep the engine busy
        self._waited_s, self._staleness, self._evicted = drained.waited_s, drained.staleness, len(drained.evicted)
        return ScoredBatch.of(drained.samples, {"rollout_s": drained.waited_s})

    def _extra_metrics(self) -> dict[str, Any]:
        return {"evicted_groups": self._evicted}

    def _in_flight(self) -> int:
        return self.ctrl.pool.in_flight


def next_drained(ctrl: BatchRolloutController, n_groups: int, build: Build, *, poll_s: float = 0.5) -> Drained:
    """Block until ``n_groups`` whole groups within the staleness bound are ready, and take them.

    The policy, not the controller's: when the buffer cannot fill the batch and nothing is in flight
    (groups were evicted or failed), one more launch at the current version fills it."""
    t0 = time.perf_counter()
    evicted: list[BufferedGroup] = []
    while True:
        got, gone = ctrl.take(n_groups)
        evicted += gone
        if got:
            version = ctrl.ledger.version
            return Drained(got, [g.staleness(version) for g in got], evicted, time.perf_counter() - t0)
        if ctrl.idle:
            ctrl.launch(build)
        ctrl.wait(poll_s)


class PrefetchDriver(_AsyncDriver):
    """``rollout.mode: async`` with ``rollout.controller``: take this step's batch (collected during the
    last step), start the next step's collect in the background (within the staleness ceiling, and never
    across a checkpoint: a prefetched batch's prompts left the cursor), train, and sync on schedule."""

    def __init__(self, c: Components, cursor: PromptCursor, config: RunConfig, kernel: Kernel, stops: list[int],
                 publisher: Publisher, *, end: int, first_step: int, will_save: Callable[[int], bool]) -> None:
        super().__init__(c, cursor, config, kernel, stops, publisher, end=end)
        r = config.rollout
        # the trainer's controller is wrapped (and becomes c.controller: checkpoints save through it)
        self.ctrl = c.controller = PrefetchingController(
            c.controller, c.engine, publisher.ledger, max_staleness=r.max_staleness,
            weight_sync_interval=r.weight_sync_interval, first_gen=first_step, on_published=publisher.published)
        self.will_save = will_save

    def _collect(self) -> list[Sample]:  # on the controller's thread; the trainer touches the cursor only quiesced
        return self.ctrl.inner.collect(lambda k: self.cursor.next(min(k, len(self.cursor.prompts))),
                                       groups=self.config.trainer.prompts_per_step, n=self.config.rollout.n,
                                       sampling=self.sampling)

    def next_batch(self, step: int) -> ScoredBatch:
        self._start()
        samples, staleness, waited_s, version = self.ctrl.next_batch(step, self._collect)
        observe_rollout(self.c, samples, self.config, self.kernel, phase="train", step=step, version=version)
        done = step + 1
        if done < self.end and not self.will_save(done):
            self.ctrl.launch(done, self._collect)  # overlaps the training of this batch
        self._waited_s, self._staleness = waited_s, staleness
        return ScoredBatch.of(samples, {"rollout_s": waited_s}, self.ctrl.metrics())

    def quiesce_on_error(self) -> None:
        self.ctrl.quiesce()  # the background drive ends before anything is closed

    def _in_flight(self) -> int:
        return self.ctrl.in_flight


def make_driver(c: Components, cursor: PromptCursor, config: RunConfig, kernel: Kernel, stops: list[int],
                publisher: Publisher, *, start: int, end: int, will_save: Callable[[int], bool],
                controller_state: dict[str, Any] | None = None) -> SyncDriver | PoolDriver | PrefetchDriver:
    """The driver of ``rollout.mode`` (async: with or without ``rollout.controller``); after the initial
    publish, so an async driver's window starts at the served version. A resumed run's controller state
    is restored here, into the controller as the driver holds it (an async one wraps the recipe's)."""
    if config.rollout.mode == "sync":
        driver: SyncDriver | PoolDriver | PrefetchDriver = SyncDriver(c, cursor, config, kernel, stops, publisher)
    elif c.controller is not None:
        driver = PrefetchDriver(c, cursor, config, kernel, stops, publisher, end=end, first_step=start,
                                will_save=will_save)
    else:
        driver = PoolDriver(c, cursor, config, kernel, stops, publisher, end=end, first_step=start)
    if c.controller is not None and controller_state is not None:
        c.controller.load_state_dict(controller_state)
    return driver
