"""How a step's batch is rolled out (docs/async.md).

* :mod:`unirl.rollout.batch` (:class:`BatchController`): ``rollout.controller: batch``, the default:
  one ``engine.generate`` per collect, scored; a plugin's controller (e.g. agentic) replaces it;
* :mod:`unirl.rollout.controller`: the launch ceiling (one pure formula), the one publish path
  (:func:`publish_next`), and :class:`PrefetchingController`, which runs the next step's collect on a
  background thread while the trainer trains (``rollout.mode: async``).

The *policy* (when to launch, when to sync, when to evaluate) stays in ``unirl.trainer.drivers``.
Nothing here knows which engine it drives.
"""
