"""unirl-fsdp: the UniRL actor scaled out over a group of Ray actors with PyTorch FSDP2.

Nothing heavy is imported here: the kernel lists this plugin without importing torch or Ray.
The actor itself is :class:`unirl_fsdp.actor.FSDPActor`.
"""


def __getattr__(name: str) -> str:
    """``__version__``: the installed distribution's version, whose one source is the repository's
    VERSION file (read lazily, so importing this package stays cheap)."""
    if name == "__version__":
        from importlib.metadata import version

        return version("unirl-fsdp")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
