"""The rank group: Ray actors, one per rank, placed together, rendezvoused, watched, cleaned up.

Why a driver-side watcher: when one rank dies, its peers block inside a collective until the process
group's own timeout (minutes). The driver therefore never blocks on a single rank: it waits on all of
them at once, and the first failure (or the step deadline) kills the whole group and raises
:class:`RankFailedError` naming the rank and its cause. The run directory is untouched by a failed
step, so the last good checkpoint is what a restart resumes from.

Ray is joined when ``RAY_ADDRESS`` (or ``ray_address``) is set, or already initialised by the caller;
otherwise a private local Ray is started on loopback and shut down on :meth:`RankGroup.shutdown`.
Actors are owned by the driver: Ray reaps them if the driver process dies, and an ``atexit`` hook and
the ``KeyboardInterrupt`` path kill them on a normal exit or Ctrl-C.
"""

from __future__ import annotations

import atexit
import os
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from unirl.api import UniRLError, WorkerLostError
from unirl_fsdp.options import FSDPOptions

#: After the first failure, how long to wait for the other ranks' outcomes: the rank that *died* is the
#: cause, a peer's "connection closed" error is only its consequence, and both can arrive in any order.
GRACE_S = 3.0


class RankFailedError(UniRLError, RuntimeError):
    """A rank died, raised, or missed the deadline. ``rank`` is the culprit, ``cause`` its error."""

    def __init__(self, rank: int | None, method: str, cause: str, others: dict[int, str] | None = None,
                 node: str | None = None):
        self.rank, self.method, self.cause, self.others = rank, method, cause, dict(others or {})
        self.node = node  # "node ab12cd34 (ip; resources), which ran rank(s) [1]" when known
        who = f"rank {rank}" if rank is not None else "the group"
        msg = f"fsdp {who} failed during {method}" + (f" on {node}" if node else "") + f": {cause}"
        for r, c in sorted(self.others.items()):
            msg += f"\n  then rank {r}: {c.splitlines()[0] if c else ''}"
        msg += "\n  (the group was stopped; resume from the last checkpoint)"
        super().__init__(msg)


class RankLostError(RankFailedError, WorkerLostError):
    """A rank's process died, or it missed the step deadline: ``run.max_restarts`` may restart the run
    from its last checkpoint. A rank that *raised* is a :class:`RankFailedError` only: restarting would
    raise again."""


def _describe(exc: BaseException) -> tuple[bool, str]:
    """(died, text): whether the rank's process is gone, and a one-paragraph cause."""
    import ray.exceptions as rex

    if isinstance(exc, rex.RayTaskError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        return False, f"{type(cause).__name__}: {cause}"
    if isinstance(exc, rex.ActorDiedError | rex.RayActorError | rex.ActorUnavailableError):
        text = str(exc).strip()
        # Ray's message is long; keep the lines that say why (exit code, signal, OOM)
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        keep = lines[:6] + [ln for ln in lines[6:] if "node" in ln and "died" in ln]
        return True, "process died: " + " | ".join(keep)
    return False, f"{type(exc).__name__}: {exc}"


def _connect_ray(options: FSDPOptions) -> bool:
    """Join ``ray_address`` / ``RAY_ADDRESS`` or start a local Ray on loopback; True when this call started it."""
    from unirl.api import connect_ray

    return connect_ray(options.ray_address, loopback=True, log_to_driver=True, configure_logging=False)


def resolve_worker_cls(spec: str | None) -> tuple[type, str | None]:
    """``actor.options.worker_cls`` (``"module:Class"``) as a class, with the sys.path root its module
    was imported from (None for an installed one); :class:`FSDPWorker` when unset."""
    from unirl_fsdp.worker import FSDPWorker

    if spec is None:
        return FSDPWorker, None
    import importlib
    from pathlib import Path

    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
        cls = module
        for part in attr.split("."):
            cls = getattr(cls, part)
    except Exception as exc:  # noqa: BLE001 - any import failure is the option's fault
        raise UniRLError(f"actor.options.worker_cls {spec!r} cannot be imported ({type(exc).__name__}: {exc}): "
                         "name an importable 'module:Class', or remove the option") from exc
    if not (isinstance(cls, type) and issubclass(cls, FSDPWorker)):
        raise UniRLError(f"actor.options.worker_cls {spec!r} is not a subclass of unirl_fsdp.worker.FSDPWorker")
    root = Path(module.__file__).resolve().parent
    for _ in range(module_name.count(".")):
        root = root.parent
    site = any(part in ("site-packages", "dist-packages") for part in root.parts)
    return cls, None if site else str(root)


class RankGroup:
    """``world_size`` Ray actors running :class:`unirl_fsdp.worker.FSDPWorker`, rendezvoused."""

    def __init__(self, *, options: FSDPOptions, worker_kwargs: dict[str, Any], worker_env: dict[str, str],
                 device: str, sys_path: Sequence[str] = ()) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        worker_cls, cls_root = resolve_worker_cls(options.worker_cls)
        roots = [r for r in (cls_root, *sys_path) if r]
        self.options = options
        self.world_size = options.world_size
        self.workers: list[Any] = []
        self.pg = None
        self.dead = False
        self._owns_ray = _connect_ray(options)
        _live_groups.add(self)
        try:
            bundle = {"CPU": options.cpus_per_rank}
            if device == "cuda":
                bundle["GPU"] = 1
            # one bundle per rank; raises ConfigError naming actor.options.placement when no node fits
            self.pg = options.placement.placement_group(self.world_size, bundle, field="actor.options.placement",
                                                        timeout_s=options.init_timeout_s)
            remote = ray.remote(worker_cls)
            env = {k: str(v) for k, v in worker_env.items()}
            if roots:  # the modules of in-process plugins and of worker_cls, importable in every rank
                env["PYTHONPATH"] = os.pathsep.join([*roots, *filter(None, [env.get("PYTHONPATH"),
                                                                            os.environ.get("PYTHONPATH")])])
            for rank in range(self.world_size):
                self.workers.append(remote.options(
                    num_cpus=options.cpus_per_rank,
                    num_gpus=1 if device == "cuda" else 0,
                    max_restarts=0,
                    max_concurrency=1,
                    runtime_env={"env_vars": env} if env else None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
                ).remote(rank=rank, world_size=self.world_size, **worker_kwargs))
            self.info = self.call("node_info", timeout=options.init_timeout_s)
            # one node: rendezvous on loopback; several: on rank 0's node address
            same_node = len({i["node_id"] for i in self.info}) == 1
            host = "127.0.0.1" if same_node else self.info[0]["ip"]
            port = self.call_rank(0, "free_port", host, timeout=options.init_timeout_s)
            self.setup = self.call("setup", host, port, timeout=options.init_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ calls
    def call(self, method: str, *args: Any, per_rank: Sequence[tuple] | None = None,
             timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every rank (``per_rank[r]`` as rank r's positional args when given) and
        return the results in rank order; raise :class:`RankFailedError` on the first failure."""
        if self.dead:
            raise RankFailedError(None, method, "the group was stopped by an earlier failure")
        refs = {}
        for rank, w in enumerate(self.workers):
            a = per_rank[rank] if per_rank is not None else args
            refs[getattr(w, method).remote(*a, **kwargs)] = rank
        return self._gather(refs, method, timeout)

    def call_rank(self, rank: int, method: str, *args: Any, timeout: float | None = None) -> Any:
        ref = getattr(self.workers[rank], method).remote(*args)
        return self._gather({ref: rank}, method, timeout)[0]

    def _gather(self, refs: dict[Any, int], method: str, timeout: float | None) -> list[Any]:
        import ray

        timeout = self.options.step_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        pending = list(refs)
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    late = sorted(refs[r] for r in pending)
                    self.shutdown()
                    raise RankLostError(late[0], method, f"no answer within {timeout:g}s "
                                          f"(step_timeout_s); ranks still running: {late}")
                ready, pending = ray.wait(pending, num_returns=1, timeout=min(left, 1.0))
                for ref in ready:
                    try:
                        results[refs[ref]] = ray.get(ref)
                    except Exception as exc:  # noqa: BLE001 - every failure ends the group
                        self._fail(refs, {refs[ref]: exc}, pending, method)
        except KeyboardInterrupt:
            self.shutdown()
            raise
        return [results[r] for r in sorted(results)]

    def _fail(self, refs: dict[Any, int], failures: dict[int, BaseException], pending: list[Any],
              method: str) -> None:
        """Collect the other ranks' outcomes for a moment, blame a dead rank first, stop the group."""
        import ray

        end = time.monotonic() + GRACE_S
        while pending and time.monotonic() < end:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, end - time.monotonic()))
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as exc:  # noqa: BLE001
                    failures[refs[ref]] = exc
        self._raise_for(method, failures)

    def stream(self, method: str, *args: Any, timeout: float | None = None,
               backpressure: int = 2) -> Iterator[Any]:
        """Iterate rank 0's generator ``method`` while every rank runs it (it holds collectives).

        Ray's streaming generators with backpressure: rank 0 pauses after ``backpressure`` unconsumed
        items, so the object store never holds the whole model. Other ranks' generators yield nothing;
        they are watched so a death anywhere ends the stream with :class:`RankFailedError`."""
        import ray

        if self.dead:
            raise RankFailedError(None, method, "the group was stopped by an earlier failure")
        timeout = self.options.step_timeout_s if timeout is None else timeout
        gens = [getattr(w, method).options(num_returns="streaming",
                                           _generator_backpressure_num_objects=backpressure).remote(*args)
                for w in self.workers]
        live = {g: r for r, g in enumerate(gens)}
        try:
            while live:
                deadline = time.monotonic() + timeout
                ready: list[Any] = []
                while not ready:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.shutdown()
                        raise RankLostError(min(live.values()), method, f"no progress within {timeout:g}s")
                    ready, _ = ray.wait(list(live), num_returns=1, timeout=min(left, 1.0))
                for gen in ready:
                    rank = live[gen]
                    try:
                        ref = next(gen)
                    except StopIteration:
                        del live[gen]
                        continue
                    try:
                        item = ray.get(ref)
                    except Exception as exc:  # noqa: BLE001
                        others = {g: r for g, r in live.items() if g is not gen}
                        self._fail_stream(rank, exc, others, method)
                    if rank == 0:
                        yield item
                        del item
        except (KeyboardInterrupt, GeneratorExit):
            # an abandoned stream leaves ranks mid-collective: the group cannot continue
            self.shutdown()
            raise

    def _fail_stream(self, rank: int, exc: BaseException, others: dict[Any, int], method: str) -> None:
        import ray

        failures = {rank: exc}
        end = time.monotonic() + GRACE_S
        for gen, r in others.items():
            try:
                while time.monotonic() < end:
                    ready, _ = ray.wait([gen], timeout=max(0.0, end - time.monotonic()))
                    if not ready:
                        break
                    ray.get(next(gen))
            except StopIteration:
                pass
            except Exception as e:  # noqa: BLE001
                failures[r] = e
        self._raise_for(method, failures)

    def _raise_for(self, method: str, failures: dict[int, BaseException]) -> NoReturn:
        """Stop the whole group and raise for the rank that failed first: a dead process beats a rank
        that merely raised (its peers usually fail *because* it died, in a collective), and a rank that
        raised beats one that only saw another rank's before-backward failure."""
        described = {r: _describe(e) for r, e in failures.items()}
        died = sorted(r for r, (d, _) in described.items() if d)
        # a rank whose own before-backward passed only echoes another rank's gate failure
        echo = {r for r, (_, text) in described.items() if text.startswith("GateFailedElsewhere")}
        culprit = died[0] if died else min(described, key=lambda r: (r in echo, r))
        node = self._node_of(culprit)
        self.shutdown()
        error = RankLostError if died else RankFailedError
        raise error(culprit, method, described[culprit][1],
                    {r: t for r, (_, t) in described.items() if r != culprit}, node=node) from failures[culprit]

    def _node_of(self, rank: int) -> str | None:
        """The culprit's node, as an error names it, with every rank that ran there (multi-node runs
        lose whole nodes, and then the question is which node and what was on it)."""
        info = getattr(self, "info", None)
        if not info:
            return None
        node_id = info[rank]["node_id"]
        ranks = [r for r, i in enumerate(info) if i["node_id"] == node_id]
        try:
            from unirl.api import describe_node

            where = describe_node(node_id)
        except Exception:  # noqa: BLE001 - the GCS may be unreachable while a cluster falls apart
            where = f"node {node_id[:8]}"
        return f"{where}, which ran rank(s) {ranks}"

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Kill every rank, free the placement group, stop a Ray this group started. Idempotent."""
        if self.dead and not self.workers:
            return
        self.dead = True
        try:
            import ray

            if ray.is_initialized():
                for w in self.workers:
                    try:
                        ray.kill(w, no_restart=True)
                    except Exception:  # noqa: BLE001 - already gone
                        pass
                if self.pg is not None:
                    from ray.util.placement_group import remove_placement_group

                    try:
                        remove_placement_group(self.pg)
                    except Exception:  # noqa: BLE001
                        pass
                if self._owns_ray:
                    ray.shutdown()
        finally:
            self.workers = []
            self.pg = None
            _live_groups.discard(self)


_live_groups: weakref.WeakSet[RankGroup] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for g in list(_live_groups):
        g.shutdown()
