"""``rollout.stream``: the streaming rollout's settings (``rollout.mode: stream``, docs/async.md).

Why a module of its own: ``unirl.config`` is at its size limit, and these keys belong to one driver
(:mod:`unirl.trainer.stream_driver`). The base is the config-wide :class:`StrictOptions` (unknown keys
and non-finite numbers refused), with the same assignment validation as every ``RunConfig`` section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from unirl.config_bounds import StrictOptions

#: the longest stall timeout accepted: a day (a bound keeps the number finite and meaningful)
STALL_TIMEOUT_MAX_S = 86_400.0


class StreamSection(StrictOptions):
    """How the stream driver keeps the engine busy and what a weight sync does to unfinished work."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)

    inflight: int | None = Field(
        None, ge=1, le=1_000_000, description="requests kept on the engine (whole groups: rounded up to a "
        "multiple of rollout.n); None: two steps' worth, 2 x trainer.prompts_per_step x rollout.n")
    groups_per_launch: int = Field(
        1, ge=1, le=4096, description="groups per launch (one collect): 1 streams group by group; more batches "
        "them on engines that run each launch as one batch (the embedded torch engine)")
    on_sync: Literal["continue", "abort"] = Field(
        "continue", description="continue: a sync pauses the engine, lets running requests end under the weights "
        "they started with, loads, and resumes the queued ones under the new weights; abort: the running requests "
        "stop, drop their partial turn and restart under the new weights (no group spans two versions)")


def stall_timeout_field() -> float:
    """``rollout.stall_timeout_s``: declared here, used by ``RolloutSection`` (see the module doc)."""
    return Field(600.0, gt=0.0, le=STALL_TIMEOUT_MAX_S, description="a launch that finishes no group for this long "
                 "fails the run as a restartable EngineStalledError naming the engine and its requests (every mode)")
