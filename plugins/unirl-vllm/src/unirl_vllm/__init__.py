"""UniRL's vLLM plugin: vLLM as a rollout engine, with versioned, receipted in-place weight sync.

Importing this package is cheap: vLLM and torch are imported only when an engine is built, so
``unirl plugins`` can list what this plugin provides on a machine without vLLM.
"""

__version__ = "0.1.0"
