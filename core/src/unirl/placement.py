"""Where Ray places a plugin's processes: ``actor.options.placement`` and ``rollout.options.placement``.

One model for every plugin that starts Ray actors (the FSDP ranks, the vLLM engine replicas), so a
recipe says "on the nodes that carry resource X / label Y" the same way for both, and a layout that
no node of the cluster can satisfy fails with the field and the nodes that exist, instead of waiting
for resources forever. Each of the group's processes is one bundle of a Ray placement group; the
``strategy`` says how the bundles spread (``PACK``, the default, fills one node first).

Layouts (see ``docs/cluster.md``):

* colocated: actor and rollout ask for the same resource (or none: PACK puts them together);
* disaggregated: ``actor.options.placement.resources: {trainer: 1}`` and
  ``rollout.options.placement.resources: {rollout: 1}``, the nodes started with those custom resources
  (``ray start --resources='{"trainer": 8}'``), or ``node_labels`` against ``ray start --labels``.

Nothing here imports Ray at module level: recipes validate without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from unirl.kernel.errors import ConfigError

#: resources the plugin sets itself from its own options (cpus_per_rank, device, ray_num_cpus)
_OWN = ("CPU", "GPU", "memory", "object_store_memory")


class Placement(BaseModel):
    """Which nodes may host each process of a group, and how the group spreads over them."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    resources: dict[str, float] = Field(
        default_factory=dict, json_schema_extra={"unbounded": "each amount is checked > 0 by _custom_only"},
        description="custom Ray resources each process reserves, e.g. {trainer: 1}: only nodes started with "
                    "them (ray start --resources) qualify")
    node_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Ray node labels each process's node must carry, e.g. {unirl/role: rollout} "
                    "(ray start --labels)")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="PACK: fill one node first; SPREAD: one per node when possible; STRICT_*: must")

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, value: dict[str, float]) -> dict[str, float]:
        for key, amount in value.items():
            if key in _OWN:
                raise ValueError(f"{key!r} is set by the plugin's own options (cpus_per_rank, ray_num_cpus, "
                                 "device); list only custom resources here")
            if amount <= 0:
                raise ValueError(f"resource {key!r}: {amount} must be > 0")
        return value

    def bundles(self, count: int, base: dict[str, float]) -> list[dict[str, float]]:
        return [{**{k: v for k, v in base.items() if v}, **self.resources} for _ in range(count)]

    def placement_group(self, count: int, base: dict[str, float], *, field: str, timeout_s: float) -> Any:
        """A ready placement group of ``count`` bundles, or :class:`ConfigError` naming ``field``.

        Checks first that some alive node could host one bundle (resources and labels), so an
        impossible layout fails at once with the nodes that exist; then waits ``timeout_s`` for the
        whole group (resources held by someone else, or too few nodes for a STRICT strategy)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        bundles = self.bundles(count, base)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        fits = [n for n in nodes if _fits(n, bundles[0], self.node_labels)]
        if not fits:
            raise ConfigError(
                f"{field}: no node of the Ray cluster can host one process needing {bundles[0]}"
                + (f" on labels {self.node_labels}" if self.node_labels else "")
                + f"; the nodes are: {'; '.join(describe_node(n) for n in nodes) or 'none'}. Fix: start nodes with "
                "those resources/labels (ray start --resources/--labels) or change the placement")
        selectors = [dict(self.node_labels) for _ in bundles] if self.node_labels else None
        kwargs = {"bundle_label_selector": selectors} if selectors else {}
        pg = placement_group(bundles, strategy=self.strategy, **kwargs)
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise ConfigError(
                f"{field}: Ray could not place {count} process(es) x {bundles[0]} with strategy {self.strategy} "
                f"within {timeout_s:g}s; nodes that qualify: {'; '.join(describe_node(n) for n in fits)}; available "
                f"now: {ray.available_resources()}. Fix: free or add resources, lower the count, or use PACK/SPREAD")
        return pg


def _fits(node: dict[str, Any], bundle: dict[str, float], labels: dict[str, str]) -> bool:
    total = node.get("Resources", {})
    have = node.get("Labels", {}) or {}
    return (all(total.get(k, 0) >= v for k, v in bundle.items())
            and all(have.get(k) == v for k, v in labels.items()))


def describe_node(node: dict[str, Any] | str) -> str:
    """``node ab12cd34 (192.0.2.2; trainer=8, labels unirl/role=trainer)``: a node as an error names it.

    Accepts a ``ray.nodes()`` entry or a node id (looked up; a node that is gone is still listed by Ray
    as dead, with its resources)."""
    if isinstance(node, str):
        import ray

        found = [n for n in ray.nodes() if n.get("NodeID") == node]
        if not found:
            return f"node {node[:8]}"
        node = found[0]
    custom = {k: v for k, v in node.get("Resources", {}).items()
              if k not in _OWN and not k.startswith("node:") and not k.startswith("accelerator_type")}
    labels = {k: v for k, v in (node.get("Labels") or {}).items() if not k.startswith("ray.io/")}
    parts = [node.get("NodeManagerAddress", "?")]
    if custom:
        parts.append(", ".join(f"{k}={v:g}" for k, v in sorted(custom.items())))
    if labels:
        parts.append("labels " + ", ".join(f"{k}={v}" for k, v in sorted(labels.items())))
    if not node.get("Alive", True):
        parts.append("dead")
    return f"node {str(node.get('NodeID', '?'))[:8]} ({'; '.join(parts)})"


@dataclass(frozen=True)
class Location:
    """One process of the run: its Ray node (None outside Ray) and pid."""

    node_id: str | None
    pid: int

    def same_process(self, other: Location) -> bool:
        return self.pid == other.pid and self.node_id == other.node_id

    def same_node(self, other: Location) -> bool:
        return self.node_id is not None and self.node_id == other.node_id


def here() -> Location:
    """This process's :class:`Location` (the Ray node id when Ray is initialized here)."""
    node = None
    try:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except ImportError:  # pragma: no cover - Ray is optional
        pass
    return Location(node, os.getpid())


def connect_ray(address: str | None = None, *, loopback: bool = False, **init_kwargs: Any) -> bool:
    """Join or start Ray for a plugin's processes; True when this call started it (the caller shuts it down).

    ``address`` (else ``RAY_ADDRESS``) joins that cluster. Without one, a fresh local Ray starts, and
    ``address="local"`` says so to Ray explicitly: a bare ``ray.init()`` instead connects to whatever
    ``/tmp/ray/ray_current_cluster`` names, and a cluster that died without cleaning up (a killed
    driver, a killed ``ray start``) leaves that file behind, so the run would wait ~15 minutes on a
    dead address before failing. ``loopback`` binds that local Ray to 127.0.0.1 (no network needed).
    A caller that already initialised Ray keeps its session.
    """
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **init_kwargs)
        return False
    for attempt in range(3):
        try:
            local = {"_node_ip_address": "127.0.0.1"} if loopback else {}
            ray.init(address="local", include_dashboard=False, **local, **init_kwargs)
            return True
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for this
            # Ray waits a fixed 30 s for its raylet; a heavily loaded machine can miss that: try again
            if "timed out during startup" not in str(exc) or attempt == 2:
                raise
            ray.shutdown()
    raise AssertionError("unreachable")  # pragma: no cover
