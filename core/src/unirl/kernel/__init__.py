"""The microkernel: hook specs, plugin manager, registries, errors. Imports neither torch nor Ray."""

from unirl.kernel.errors import ConfigError, PluginError, PreflightError, UniRLError, Violation
from unirl.kernel.hookspecs import hookimpl, hookspec
from unirl.kernel.manager import Entry, Kernel, PluginRecord, load_kernel

__all__ = [
    "ConfigError", "Entry", "Kernel", "PluginError", "PluginRecord", "PreflightError", "UniRLError",
    "Violation", "hookimpl", "hookspec", "load_kernel",
]
