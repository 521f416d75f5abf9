"""Train-inference mismatch, decomposed: numerics (engine vs trainer on the same weights) and staleness
(the weights that sampled a token vs the weights being trained). docs/mismatch.md explains both.

* :mod:`unirl.mismatch.stats` - the statistics (mean |dlogp|, k3 KL, shares beyond 1e-3 and 1e-1), pure;
* :mod:`unirl.mismatch.monitor` - the trainer's side: which versions to keep, when to replay, the metrics;
* :mod:`unirl.mismatch.alarm` - the numerics alarm and its table of likely causes.
"""
