"""Async rollout: the mechanism that lets the engine generate while the trainer trains.

Three small pieces, each owning one invariant (docs/async.md):

* :mod:`unirl.rollout.buffer` (:class:`VersionedBuffer`): finished groups wait here, stamped with the
  weight version they were launched under; a drain returns the freshest whole groups and evicts those
  older than the staleness bound;
* :mod:`unirl.rollout.pool` (:class:`InflightPool`): launches on a :class:`~unirl.contracts.RolloutEngine`
  through ``submit`` and reaps through ``poll``, complete-or-nothing;
* :mod:`unirl.rollout.controller` (:class:`BatchRolloutController`): when a launch may start (the launch
  ceiling), quiescing, and the only way weights are pushed.

The *policy* (when to launch, when to sync, when to evaluate) stays in ``unirl.trainer.loop``. Nothing
here knows which engine it drives: the embedded torch engine and vLLM (in-process or Ray-hosted) are
driven through the same contract methods.
"""
