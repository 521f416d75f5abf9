"""Rollout Routing Replay (R3) for Mixture-of-Experts models (``algorithm.routing_replay: true``).

Why: in an MoE model a last-bit difference in a router logit between the rollout engine and the
trainer can send a token through other experts, and the trainer then scores a path the engine never
took; that is the largest train-inference mismatch MoE RL runs see (arXiv 2510.11370). R3 records the
engine's top-k expert ids for every sampled token and makes the trainer's forward use them.

* :mod:`unirl.routing.routers` - what a router is here: :class:`RouterSpec` (the adapter declares its
  model's routers, ``ModelAdapter.routers``; only MoE adapters have any).
* :mod:`unirl.routing.record` - engine side: :class:`RouteRecorder` captures each decode step's
  top-k ids per layer; :func:`attach_routes` stores them on the sample (``Sample.routing``, int16
  ``[response tokens, layers, k]``, -1 where nothing was recorded).
* :mod:`unirl.routing.replay` - trainer side: :class:`RouteReplay` routes each response token to its
  recorded experts, gate weights from the trainer's own softmax, and measures ``routing/agreement``
  (trainer top-k equal to the recorded one, before replay).

Which input position a record belongs to: the routing of response token ``j`` is the routing of the
forward that *fed* token ``j`` (the decode step after it was sampled). The trainer's packed forward
routes the same input token at the same position, so that is where the record is replayed. The last
sampled token is never fed, so it has no record; its own routing does not reach any log-prob.
"""

from unirl.routing.record import RouteRecorder, attach_routes, recorder_for, routes_of
from unirl.routing.replay import RouteReplay, install, prepare, replay_for, step_metrics
from unirl.routing.routers import NO_EXPERT, RouterSpec, gate_weights

__all__ = ["NO_EXPERT", "RouteRecorder", "RouteReplay", "RouterSpec", "attach_routes", "gate_weights", "install",
           "prepare", "recorder_for", "replay_for", "routes_of", "step_metrics"]
