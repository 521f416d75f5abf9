"""UniRL: reinforcement-learning post-training of language models, as a plugin microkernel.

Importing ``unirl`` is cheap: no torch, no Ray. Heavy modules load when a run selects them.
"""


def __getattr__(name: str) -> str:
    """``__version__``: the installed distribution's version, whose one source is the repository's
    VERSION file (read lazily, so importing this package stays cheap)."""
    if name == "__version__":
        from importlib.metadata import version

        return version("unirl-core")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
