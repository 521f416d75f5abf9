"""UniRL's vLLM plugin: vLLM as a rollout engine, with versioned, receipted in-place weight sync.

Importing this package is cheap: vLLM and torch are imported only when an engine is built, so
``unirl plugins`` can list what this plugin provides on a machine without vLLM.
"""


def __getattr__(name: str) -> str:
    """``__version__``: the installed distribution's version, whose one source is the repository's
    VERSION file (read lazily, so importing this package stays cheap)."""
    if name == "__version__":
        from importlib.metadata import version

        return version("unirl-vllm")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
