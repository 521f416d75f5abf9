"""``rollout.mode: stream``: the driver over :class:`unirl.rollout.stream.StreamingController`.

Why a driver of its own: sync and async hand the trainer one collect per step; stream keeps the engine
at ``rollout.stream.inflight`` requests all the time (one-group launches of the trainer's controller,
so every controller that declares ``concurrent_collects`` gets it), and a step takes
``trainer.prompts_per_step`` whole groups from the buffer, oldest first, within ``max_staleness``
(launching stops at :func:`unirl.rollout.stream.held_ceiling`: nothing is generated to be evicted).
Weights sync every ``rollout.weight_sync_interval`` steps by pausing the engine, not by draining it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from unirl.config import RunConfig
from unirl.contracts import SamplingParams
from unirl.data.datasets import PromptCursor
from unirl.kernel.manager import Kernel
from unirl.rollout.stream import StreamingController
from unirl.samples import Sample
from unirl.trainer.components import Components
from unirl.trainer.phases import phase
from unirl.trainer.rollouts import observe_rollout
from unirl.trainer.step import ScoredBatch


def stream_slots(config: RunConfig) -> tuple[int, int]:
    """(launches kept running, requests they hold): ``rollout.stream.inflight`` rounded up to whole launches
    (``groups_per_launch`` groups of ``rollout.n``); unset, two steps' worth."""
    r, k = config.rollout, config.trainer.prompts_per_step
    per_launch = r.n * r.stream.groups_per_launch
    requests = r.stream.inflight or 2 * k * r.n
    slots = max(1, -(-requests // per_launch))
    return slots, slots * per_launch


class StreamDriver:
    """Take whole groups as they finish; sync by pause / load / resume; drain before eval and checkpoints
    (the loop's ``quiesce``), so a checkpoint stores the buffer and nothing runs (docs/async.md)."""

    def __init__(self, c: Components, cursor: PromptCursor, config: RunConfig, kernel: Kernel, stops: list[int],
                 publisher: Any, *, end: int, first_step: int) -> None:
        self.c, self.config, self.kernel, self.end, self.first = c, config, kernel, end, first_step
        r = config.rollout
        self.slots, self.inflight = stream_slots(config)
        sampling, lock, inner = SamplingParams.from_config(config, stops), threading.Lock(), c.controller

        def draw(k: int) -> list[Sample]:  # launches draw concurrently; the cursor is not thread-safe
            with lock:
                return cursor.next(min(k, len(cursor.prompts)))

        def collect_group(tag: str) -> list[Sample]:
            return inner.collect(draw, groups=r.stream.groups_per_launch, n=r.n, sampling=sampling, launch_tag=tag)

        self.ctrl = StreamingController(  # the driver's own, around the recipe's controller
            inner, c.engine, publisher.ledger, collect_group=collect_group, slots=self.slots,
            max_staleness=r.max_staleness, stall_timeout_s=r.stall_timeout_s, engine_name=r.engine,
            buffer_cap=config.trainer.prompts_per_step * (r.max_staleness + 1), on_published=publisher.published,
            on_sync=r.stream.on_sync, take_size=config.trainer.prompts_per_step,
            sync_interval=r.weight_sync_interval, groups_per_launch=r.stream.groups_per_launch)
        self._staleness: list[int] = []

    def next_batch(self, step: int) -> ScoredBatch:
        t0 = time.perf_counter()
        groups = self.ctrl.take(self.config.trainer.prompts_per_step)
        waited = time.perf_counter() - t0
        samples = [s for g in groups for s in g.samples]
        self._staleness = [s.meta["staleness"] for g in groups for s in g.samples[:1]]
        observe_rollout(self.c, samples, self.config, self.kernel, phase="train", step=step,
                        version=self.ctrl.ledger.version)
        return ScoredBatch.of(samples, {"rollout_s": waited}, self.ctrl.metrics())

    def after_update(self, step: int, metrics: dict[str, Any]) -> None:
        last = step + 1 == self.end
        with phase("sync", metrics):
            if last:
                self.ctrl.quiesce()  # the run ends: launch nothing more (eval and export follow)
            if (step + 1 - self.first) % self.config.rollout.weight_sync_interval == 0 or last:
                t1 = time.perf_counter()
                self.ctrl.sync_weights(self.c.sync, self.c.actor)
                metrics["publish_lag_s"] = time.perf_counter() - t1
        metrics["version"] = self.ctrl.ledger.version
        st = self._staleness
        metrics.update({"staleness_mean": sum(st) / max(len(st), 1), "staleness_max": max(st, default=0)})
        for s in range(self.config.rollout.max_staleness + 1):  # the histogram over this step's groups
            metrics[f"stream/staleness_{s}"] = float(st.count(s))
        metrics.update(self.ctrl.step_metrics(self.inflight // self.slots, self.inflight))

    def quiesce(self) -> None:
        self.ctrl.quiesce()

    def quiesce_on_error(self) -> None:
        self.ctrl.quiesce()

    def state_dict(self) -> dict[str, Any]:
        """The wrapper's state: the recipe's controller's, the buffer and the launch counter."""
        return self.ctrl.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ctrl.load_state_dict(state)

    def close(self) -> None:
        """The launches end; the recipe's controller stays open (the components close it)."""
        self.ctrl.stop()
