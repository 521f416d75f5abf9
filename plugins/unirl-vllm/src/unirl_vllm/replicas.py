"""How :class:`unirl_vllm.engine.VLLMEngine` reaches its replicas, and the errors when one is lost.

A replica is a :class:`unirl_vllm.host.Host`, in the trainer's process or inside one Ray actor
(:class:`RayHost`, same methods, blocking, plus ``remote``/``result`` to overlap calls).
:func:`call_all` runs one method on several replicas at once; :func:`transports` picks the weight
carrier to each (:mod:`unirl.sync.transport`). Kept apart from the engine so the engine reads as
the trainer's contract (submit, sync) and this module as the plumbing under it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from unirl.api import WeightSyncError, WorkerLostError, connect_ray
from unirl_vllm.host import Host

if TYPE_CHECKING:  # pragma: no cover
    from unirl.api import Runtime


class EngineReplicaLost(WorkerLostError, RuntimeError):
    """A vLLM replica's Ray actor died (its process, or its whole node): named with the node."""


class ReplicaLostInSync(WeightSyncError, EngineReplicaLost):
    """A replica died during a weight sync: the ledger keeps the old version (a sync failure), and the
    run may restart from its last checkpoint (a lost worker: ``run.max_restarts``)."""


class RayHost:
    """A :class:`~unirl_vllm.host.Host` inside one Ray actor (one replica); same methods, blocking, plus
    :meth:`remote`."""

    def __init__(self, llm_kwargs: dict[str, Any], env: dict[str, str], bucket_bytes: int, num_cpus: float,
                 runtime: Runtime, *, index: int = 0, scheduling: Any = None,
                 model_files: Any = None) -> None:
        import ray

        connect_ray(log_to_driver=False)
        actor_cls = ray.remote(Host)
        self._ray = ray
        self.index = index
        self.info_: dict[str, Any] = {}
        opts: dict[str, Any] = {"num_cpus": num_cpus, "runtime_env": {"env_vars": env}, "max_restarts": 0}
        if scheduling is not None:
            opts["scheduling_strategy"] = scheduling
        self._actor = actor_cls.options(**opts).remote(llm_kwargs, env, bucket_bytes, runtime, model_files)

    def remote(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Start ``name`` on the replica; the object ref (resolve it with :meth:`result`)."""
        return getattr(self._actor, name).remote(*args, **kwargs)

    def result(self, ref: Any, what: str) -> Any:
        """``ray.get(ref)``; a dead replica raises :class:`EngineReplicaLost` naming it and its node."""
        import ray.exceptions as rex

        try:
            return self._ray.get(ref)
        except (rex.RayActorError, rex.ActorUnavailableError) as exc:
            raise EngineReplicaLost(f"vllm replica {self.index} {self.where()} was lost during {what}: "
                                    f"{_death_cause(exc)}. Restart from the latest checkpoint (run.resume=true), "
                                    "or set run.max_restarts to let the trainer do it") from exc

    def where(self) -> str:
        node = self.info_.get("node_id")
        if node is None:
            return "(not started)"
        try:
            from unirl.api import describe_node

            return f"on {describe_node(node)}"
        except Exception:  # noqa: BLE001 - the GCS may be unreachable while a cluster falls apart
            return f"on node {node[:8]}"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.result(self.remote(name, *args, **kwargs), name)

        return call

    def close(self) -> None:
        try:
            self._ray.get(self._actor.close.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - a dead replica has nothing left to close
            pass
        finally:
            self._ray.kill(self._actor)


def _death_cause(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    node_lines = [ln for ln in lines if "node" in ln and "died" in ln]
    return " | ".join(node_lines or lines[:2])


def model_files(model_dir: str) -> dict[str, bytes]:
    """Every file of a (small, driver-built) model directory, to ship through Ray's object store."""
    root = Path(model_dir)
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def call_all(hosts: list[Any], calls: list[tuple[int, str, tuple]]) -> list[Any]:
    """Run ``(replica, method, args)`` calls; Ray replicas all at once, results in order."""
    if not isinstance(hosts[0], RayHost):
        return [getattr(hosts[r], m)(*a) for r, m, a in calls]
    refs = [hosts[r].remote(m, *a) for r, m, a in calls]
    return [hosts[r].result(ref, m) for (r, m, _), ref in zip(calls, refs, strict=True)]


def transports(hosts: list[Any]) -> list[str]:
    """The weight transport to each replica, chosen by where it is (:mod:`unirl.sync.transport`)."""
    from unirl.api import Location, choose_transport, here

    me = here()
    out = []
    for h in hosts:
        info = h.info_ if isinstance(h, RayHost) else None
        out.append("inprocess" if info is None else choose_transport(me, Location(info["node_id"], info["pid"])))
    return out


def call_failures(hosts: list[Any]) -> tuple[type[BaseException], ...]:
    """What a call to these replicas raises when the replica, not the caller, failed.

    A Ray replica that died raises :class:`EngineReplicaLost` (:meth:`RayHost.result`); one whose
    method raised re-raises it as Ray's ``RayTaskError``. An in-process host raises vLLM's own errors
    (``VLLMError``: ``EngineDeadError`` once its engine-core process died). Named so that clean-up on
    an error path (aborting requests) catches these and nothing else: a bug in the caller still shows."""
    from vllm.exceptions import VLLMError

    if hosts and isinstance(hosts[0], RayHost):
        from ray.exceptions import RayError

        return (EngineReplicaLost, RayError, VLLMError)
    return (EngineReplicaLost, VLLMError)
