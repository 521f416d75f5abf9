"""The microkernel: hook specs, plugin manager, registries, errors. Imports neither torch nor Ray."""

from unirl.kernel.errors import (
    ConfigError,
    PluginError,
    PreflightError,
    SampleError,
    SyncRefusedError,
    UniRLError,
    Violation,
    WeightSyncError,
)
from unirl.kernel.hookspecs import hookimpl, hookspec
from unirl.kernel.manager import Entry, Kernel, KernelHooks, KernelSpec, PluginRecord, load_kernel

__all__ = [
    "ConfigError", "Entry", "Kernel", "KernelHooks", "KernelSpec", "PluginError", "PluginRecord", "PreflightError", "SampleError",
    "SyncRefusedError", "UniRLError", "Violation", "WeightSyncError", "hookimpl", "hookspec", "load_kernel",
]
