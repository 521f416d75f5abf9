"""UniRL: reinforcement-learning post-training of language models, as a plugin microkernel.

Importing ``unirl`` is cheap: no torch, no Ray. Heavy modules load when a run selects them.
"""

__version__ = "0.1.0"
