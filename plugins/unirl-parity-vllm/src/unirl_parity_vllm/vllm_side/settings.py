"""What every vLLM process of a parity run is told, read from its environment: the profile's settings.

The trainer sets these variables for every vLLM process (``unirl_worker_env``); the installer, the kernels
and the MoE layers read them here. Why a module of its own: those submodules used to import them back
from the package ``__init__``, which imports the installer in turn (a cycle through function-level
imports). This module imports nothing of the package, nor torch or vLLM.
"""

from __future__ import annotations

import os

ENTRY_POINT_NAME = "unirl_parity"
#: the profile's ``strict`` (``plugins.parity.strict``), set by the trainer for every vLLM process
#: (``unirl_worker_env``): "1" (the default, also when unset) or "0"
STRICT_ENV = "UNIRL_PARITY_STRICT"
#: the profile's ``platform`` (``plugins.parity.platform``: cpu | cuda), set by the trainer for every vLLM
#: process like strict mode; unset means cpu (the verified platform)
PLATFORM_ENV = "UNIRL_PARITY_PLATFORM"
#: the profile's ``tp_gather_cache`` (``plugins.parity.tp_gather_cache``), set like strict mode: "1" or "0";
#: unset means on for the cpu platform, off for cuda (:func:`tp_gather_cache`)
TP_CACHE_ENV = "UNIRL_PARITY_TP_CACHE"


def strict() -> bool:
    """The profile's strict mode as this process received it; unset means strict (fail closed).

    Strict: any vLLM version outside the verified set is refused, even when every symbol still checks.
    Non-strict: such a version is admitted when every private symbol's signature, the reference ops and
    the internals they rely on check; it is recorded in the manifest (``unverified``). An unverified
    symbol or op (a missing symbol, a changed signature, a platform without the ops) is refused either way."""
    return os.environ.get(STRICT_ENV, "1") != "0"


def platform() -> str:
    """The vLLM platform the profile declares, as this process received it (unset: ``cpu``). The
    installer refuses to install on any other platform than this one (``installer.preflight``)."""
    return os.environ.get(PLATFORM_ENV, "cpu").strip().lower() or "cpu"


def tp_gather_cache() -> bool:
    """Whether a TP rank keeps the full weights it all-gathers for the shard-invariant row-parallel linears
    and MoE experts, until the next weight load (``kernels.ParityLinear``, ``moe.gather_experts``).

    On: one gather per weight version instead of one per forward (the MoE x TP2 arm's rollout was 1.61x
    parity off with a gather per forward). The cost is memory: every rank then holds those layers unsharded,
    as at TP1. So the default is on for the cpu platform (tiny models, host memory) and off for cuda, where
    a large model's experts held whole on every GPU would not fit beside the KV cache."""
    value = os.environ.get(TP_CACHE_ENV, "").strip()
    return value == "1" if value else platform() == "cpu"
