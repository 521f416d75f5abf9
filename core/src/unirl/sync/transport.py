"""How a weight sync's staged buckets reach an engine worker, chosen by where the two ends are.

The staged copy of a sync (:class:`unirl.weights.Staged`) lives in the trainer's process. An engine
host (a vLLM replica, say) may live in that same process, in another process on the same node, or on
another node, and the three need different carriers:

* ``inprocess``: same process: the staged tensors are handed over as they are;
* ``shm``: same node, other process: each bucket is written once as a safetensors file on the node's
  tmpfs (``/dev/shm``) and every host on that node reads the same file. A path on tmpfs means nothing
  on another node, so this is never chosen across nodes;
* ``object_store``: another node: each bucket is put once into Ray's object store and every host
  fetches it (Ray's object manager moves the bytes between nodes; several replicas share one put).

The receipt of every worker names the transport that fed it (:attr:`unirl.contracts.Receipt.transport`),
so a ledger entry says how the bytes travelled.
"""

from __future__ import annotations

from typing import Literal

from unirl.placement import Location

Transport = Literal["inprocess", "shm", "object_store"]
TRANSPORTS: tuple[Transport, ...] = ("inprocess", "shm", "object_store")


def choose_transport(source: Location, target: Location) -> Transport:
    """The carrier from ``source`` (where the staged tensors are) to ``target`` (an engine host)."""
    if source.same_process(target):
        return "inprocess"
    if source.same_node(target):
        return "shm"
    return "object_store"


__all__ = ["TRANSPORTS", "Transport", "choose_transport"]
