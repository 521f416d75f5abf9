"""UniRL's SGLang plugin: SGLang servers as a rollout engine, driven over SGLang's native HTTP API.

Importing this package is cheap: torch is imported only when an engine is built, so ``unirl plugins``
lists what it provides on a machine without torch or SGLang.
"""


def __getattr__(name: str) -> str:
    """``__version__``: the installed distribution's version, whose one source is the repository's
    VERSION file (read lazily, so importing this package stays cheap)."""
    if name == "__version__":
        from importlib.metadata import version

        return version("unirl-sglang")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: the SGLang release whose HTTP API this plugin follows (see README: sources read)
SGLANG_VERSION = "0.5.23"
