"""Errors that reach users.

Every error a user can cause carries enough to fix it: the file, the field or the distribution, and a
hint. The CLI prints them as one message without a traceback (``--debug`` shows it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class UniRLError(Exception):
    """Base of every error UniRL raises on purpose (bad input, bad plugin, failed check)."""


@dataclass(frozen=True)
class Violation:
    """One problem found by preflight: where it is, what is wrong, how to fix it."""

    source: str  # distribution (or "unirl-core") that found it
    field: str  # dotted config path, e.g. "rollout.options.max_model_len"
    message: str
    fix: str = ""

    def __str__(self) -> str:
        fix = f" (fix: {self.fix})" if self.fix else ""
        return f"[{self.source}] {self.field}: {self.message}{fix}"


class ConfigError(UniRLError):
    """A recipe or override is malformed. The message names the file and the field."""


class PluginError(UniRLError):
    """A plugin misbehaved: failed to import, registered a duplicate name, returned the wrong type."""


class PreflightError(UniRLError):
    """Preflight found violations; ``violations`` holds all of them, from every plugin."""

    def __init__(self, violations: list[Violation]):
        self.violations = list(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"preflight found {len(self.violations)} problem(s):\n{lines}")


class OptionsError(ConfigError):
    """A component's options section does not validate against the model it declares (``Config``).

    Raised by :meth:`unirl.kernel.manager.Kernel.build` (and read by preflight, which reports
    ``violations`` as they are: the one validation of a component's options)."""

    def __init__(self, violations: list[Violation]):
        self.violations = list(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"invalid options ({len(self.violations)} problem(s)):\n{lines}")


class DataError(UniRLError):
    """A dataset row is malformed. The message names the file and the row."""


class WeightSyncError(UniRLError):
    """A weight payload was rejected or failed to load; the engine still serves its last version.

    Raised by :mod:`unirl.weights` (shared by every engine) before any served tensor is touched."""


class SyncRefusedError(WeightSyncError):
    """A weight sync was attempted while requests were in flight: drain, abort or pause first.

    The old version keeps serving. The trainer quiesces the engine before every sync, so seeing this
    means a controller launched work it did not reap."""


class SampleError(UniRLError):
    """An engine or environment returned a malformed sample; the message names the sample and the engine."""


class WorkerLostError(UniRLError):
    """A process the run depends on died or stalled: an FSDP rank, an engine replica or actor, an
    environment worker. Plugins' errors for it subclass this, so ``run.max_restarts`` can restart the
    run from its last checkpoint without knowing any plugin (the message names the worker)."""


def violations_from(exc: Any, source: str, prefix: str, fix: str = "") -> list[Violation]:
    """One :class:`Violation` per error of a pydantic ``ValidationError`` (duck-typed: anything with
    ``errors()``), each field named ``<prefix>.<loc>`` (just ``prefix`` for a model-level rule).

    Why one converter: preflight, the judge's checks and every plugin's options check turned
    ``ValidationError`` into violations, each its own way; a user then read one field path style from
    core and another from a plugin."""
    return [Violation(source, ".".join([prefix, *map(str, err.get("loc", ()))]), str(err.get("msg", err)), fix)
            for err in exc.errors()]
