"""Environments on a Ray worker pool (``plugins.agentic.env_workers: N``).

Why: an environment step can be heavy (a game engine, a search index, a sandbox), and in-process it runs
on the trainer's host process, competing with the engine. With ``env_workers: N`` every environment
instance lives in one of N Ray actors (:class:`EnvWorker`), and :class:`EnvPool` stands in for the
environment in the controller, as a coordinator:

* **hand out**: a trajectory is pinned at ``reset`` to the live worker with the fewest live trajectories
  (the worker with room pulls the next one); all its steps run there, where its state is;
* **gather**: each ``step`` is one call to that worker, and what the environment wrote into the sample's
  ``meta`` comes back with the :class:`~unirl.contracts.EnvStep`;
* **a lost worker fails only its trajectories**: a worker that dies (killed, out of memory) is marked
  lost; each trajectory pinned to it ends failed at its next step (``info["failure"]``: reward NaN,
  excluded from its group, never a miss) and is counted (``stats.failed_trajectories``); trajectories on
  other workers and new ones (pinned to live workers) carry on, so the drive continues. With no live
  worker left, a reset fails its trajectory with the fix.

The pool builds each worker's environment from a picklable factory (by default the registry entry
``rollout.environment`` with ``rollout.tools``, built inside the worker from its own kernel).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unirl.api import Environment, EnvStep, Sample

EnvFactory = Callable[[], Environment]


def _ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError("plugins.agentic.env_workers needs ray; fix: pip install 'unirl-agentic[pool]' "
                          "(or set env_workers: 0 to run environments in-process)") from exc
    return ray


class EnvWorker:
    """One Ray actor holding one environment instance, serving every trajectory pinned to it."""

    def __init__(self, factory: EnvFactory):
        self.env = factory()
        self.samples: dict[str, Sample] = {}

    def pid(self) -> int:
        return os.getpid()

    def stateful(self) -> bool:
        return bool(getattr(self.env, "stateful", False))

    def stop(self) -> tuple[str, ...]:
        return tuple(getattr(self.env, "stop", ()) or ())

    def reset(self, sample: Sample) -> dict[str, Any]:
        self.samples[sample.id] = sample
        self.env.reset(sample)
        return dict(sample.meta)

    def step(self, sample: Sample, turn_text: str) -> tuple[EnvStep, dict]:
        # the trajectory as the controller has it now (tokens, turns, meta); the environment's own state for
        # it lives here, keyed by its id
        self.samples[sample.id] = sample
        step = self.env.step(sample, turn_text)
        return step, dict(sample.meta)

    def demonstrations(self, prompts: list[Sample], tokenizer: Any, expert: list[bool]) -> list[Sample]:
        return [self.env.demonstration(p, tokenizer, expert=e) for p, e in zip(prompts, expert, strict=True)]

    def close(self, sample_id: str) -> None:
        s = self.samples.pop(sample_id, None)
        if s is not None:
            self.env.close(s)


@dataclass
class PoolStats:
    steps: int = 0
    lost_workers: list[int] = field(default_factory=list)
    failed_trajectories: int = 0  # trajectories that ended failed because their worker was lost
    failed_ids: list[str] = field(default_factory=list)
    assigned: dict[str, int] = field(default_factory=dict)  # trajectory id -> the worker it was pinned to


class EnvPool(Environment):
    """The controller's environment when ``env_workers > 0`` (see the module doc)."""

    def __init__(self, factory: EnvFactory, workers: int, *, num_cpus: float = 0.5):
        if workers < 1:
            raise ValueError(f"plugins.agentic.env_workers must be >= 1 for a pool, got {workers}")
        ray = _ray()
        self._ray = ray
        remote = ray.remote(num_cpus=num_cpus, max_restarts=0)(EnvWorker)
        self.workers = [remote.remote(factory) for _ in range(workers)]
        self.pids = ray.get([w.pid.remote() for w in self.workers])
        self._stateful = ray.get(self.workers[0].stateful.remote())
        self.stop = ray.get(self.workers[0].stop.remote())
        self._live: set[int] = set(range(workers))
        self._pinned: dict[str, int] = {}
        self._load = [0] * workers
        self._lock = threading.Lock()
        self.stats = PoolStats()

    @property
    def stateful(self) -> bool:
        return self._stateful

    def live(self) -> list[str]:
        with self._lock:
            return list(self._pinned)

    def _lost(self, w: int, exc: BaseException) -> str:
        with self._lock:
            if w in self._live:
                self._live.discard(w)
                self.stats.lost_workers.append(w)
        return f"env worker {w} (pid {self.pids[w]}) was lost: {type(exc).__name__}"

    def reset(self, sample: Sample) -> None:
        while True:
            with self._lock:
                if not self._live:
                    raise RuntimeError(f"every env worker ({len(self.workers)}) was lost; fix: check the workers' "
                                       "logs (memory, crashes), or run in-process with plugins.agentic.env_workers: 0")
                w = min(self._live, key=lambda i: (self._load[i], i))
                self._load[w] += 1
                self._pinned[sample.id] = self.stats.assigned[sample.id] = w
            try:
                meta = self._ray.get(self.workers[w].reset.remote(sample))
            except self._ray.exceptions.RayActorError as exc:
                self._lost(w, exc)
                with self._lock:
                    self._load[w] -= 1
                    del self._pinned[sample.id]
                continue  # pinned to a worker that is gone: the next live one takes it
            sample.meta.update(meta)
            return

    def step(self, sample: Sample, turn_text: str) -> EnvStep:
        with self._lock:
            w = self._pinned.get(sample.id)
            alive = w in self._live
        if w is None:
            raise ValueError(f"env pool: step for {sample.id} before reset (or after close)")
        if alive:
            try:
                step, meta = self._ray.get(self.workers[w].step.remote(sample, turn_text))
            except self._ray.exceptions.RayActorError as exc:
                reason = self._lost(w, exc)
            else:
                sample.meta.update(meta)
                with self._lock:
                    self.stats.steps += 1
                return step
        else:
            reason = f"env worker {w} (pid {self.pids[w]}) was lost"
        with self._lock:
            self.stats.failed_trajectories += 1
            self.stats.failed_ids.append(sample.id)
        return EnvStep(done=True, info={"failure": f"{reason}; its trajectories fail, the drive continues"})

    def close(self, sample: Sample) -> None:
        with self._lock:
            w = self._pinned.pop(sample.id, None)
            if w is None:
                return
            self._load[w] -= 1
            alive = w in self._live
        if alive:
            try:
                self._ray.get(self.workers[w].close.remote(sample.id))
            except self._ray.exceptions.RayActorError as exc:
                self._lost(w, exc)

    def demonstration(self, prompt: Sample, tokenizer: Any, *, expert: bool) -> Sample:
        """``warm_start: env`` through the pool: the demonstration is played by a live worker's environment."""
        with self._lock:
            w = min(self._live) if self._live else 0
        return self._ray.get(self.workers[w].demonstrations.remote([prompt], tokenizer, [expert]))[0]

    def shutdown(self) -> None:
        """End every worker (the pool's own processes)."""
        for w in self.workers:
            try:
                self._ray.kill(w)
            except Exception:  # noqa: BLE001, S110 - already gone
                pass


@dataclass(frozen=True)
class RegistryEnvFactory:
    """Builds ``rollout.environment`` (with ``rollout.tools``) inside a worker, from the worker's kernel."""

    config: Any

    def __call__(self) -> Environment:
        from unirl.api import load_kernel

        kernel = load_kernel()
        tools = {name: kernel.build("tools", name, config=self.config) for name in self.config.rollout.tools}
        return kernel.build("environments", self.config.rollout.environment, config=self.config, tools=tools,
                            tokenizer=None)
