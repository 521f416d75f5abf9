"""``diagnostics``: the train-inference mismatch metrics and their alarm (docs/mismatch.md).

Why a module of its own: ``unirl.config`` is at its size limit, and these keys belong to one consumer
(:mod:`unirl.mismatch`). The base is the config-wide :class:`StrictOptions` (unknown keys and
non-finite numbers refused), with the same assignment validation as every ``RunConfig`` section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from unirl.config_bounds import StrictOptions


class DiagnosticsSection(StrictOptions):
    """How often the mismatch is decomposed (numerics vs staleness) and what a large numerics term does."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)

    mismatch_every: int = Field(
        10, ge=0, le=1_000_000, description="async / stream: replay a step's batch at the weight versions that "
        "sampled it every this many steps (the trainer keeps the versions in the staleness window on the CPU); "
        "0 turns the decomposition off. Sync mode reports it every step at no cost (its staleness is 0)")
    mismatch_alarm: Literal["warn", "error", "off", False] = Field(
        "warn", description="when the numerics term's k3 KL exceeds mismatch_threshold over a step: warn once "
        "naming the likely causes and the parity profile that removes them, error (stop the run), or off "
        "(YAML: false)")
    mismatch_threshold: float = Field(
        1e-3, gt=0.0, le=1e6, description="the alarm's bound on the step's mean numerics k3 KL")
