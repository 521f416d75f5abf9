"""UniRL's SGLang plugin: SGLang servers as a rollout engine, driven over SGLang's native HTTP API.

Importing this package is cheap: torch is imported only when an engine is built, so ``unirl plugins``
lists what it provides on a machine without torch or SGLang.
"""

__version__ = "0.1.0"

#: the SGLang release whose HTTP API this plugin follows (see README: sources read)
SGLANG_VERSION = "0.5.23"
