"""The vLLM side of unirl-parity-vllm: batch-invariant reference ops installed into vLLM.

``register`` is the ``vllm.general_plugins`` entry point (name ``unirl_parity``). vLLM calls it once
in every process it runs (the main process, ``EngineCore`` and each ``Worker``; or one process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), before any model is built. It does nothing unless
``UNIRL_PARITY_ENABLE=1``; then it runs :func:`install` (phase 1 checks everything, phase 2 replaces,
fail closed) and writes this process's manifest to ``$UNIRL_PARITY_MANIFEST_DIR`` when set. An error
propagates, so vLLM fails to start rather than serve inexact log-probs.

If ``VLLM_PLUGINS`` is set it is an allowlist of entry-point names and must include ``unirl_parity``
(:func:`allowlist_problem` says so; the trainer-side preflight reports it).

This module imports neither torch nor vLLM: vLLM imports it in every process, enabled or not.
"""

from __future__ import annotations

import os
from typing import Any

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


def register() -> None:
    """``vllm.general_plugins`` entry point: install the parity ops when ``UNIRL_PARITY_ENABLE=1``."""
    from unirl_parity_vllm import parity_enabled

    if not parity_enabled():
        return
    from unirl_parity_vllm.vllm_side.installer import install

    install()


def allowlist_problem() -> str | None:
    """Why vLLM would not load this plugin (``VLLM_PLUGINS`` set without it), else None."""
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is None:
        return None
    names = [n.strip() for n in allowed.split(",")]
    if ENTRY_POINT_NAME in names:
        return None
    return (f"VLLM_PLUGINS={allowed!r} does not include {ENTRY_POINT_NAME!r}: vLLM would not load the parity "
            f"plugin in its processes (add it to the list, or unset VLLM_PLUGINS)")


def install(**kwargs: Any) -> dict[str, Any]:
    from unirl_parity_vllm.vllm_side.installer import install as _install

    return _install(**kwargs)


def uninstall() -> None:
    from unirl_parity_vllm.vllm_side.installer import uninstall as _uninstall

    _uninstall()


def installed() -> bool:
    from unirl_parity_vllm.vllm_side.installer import installed as _installed

    return _installed()


def manifest() -> dict[str, Any]:
    from unirl_parity_vllm.vllm_side.installer import manifest as _manifest

    return _manifest()


def preflight() -> list[str]:
    from unirl_parity_vllm.vllm_side.installer import preflight as _preflight

    return _preflight()


__all__ = ["ENTRY_POINT_NAME", "PLATFORM_ENV", "STRICT_ENV", "TP_CACHE_ENV", "platform", "tp_gather_cache", "allowlist_problem", "install", "installed", "manifest", "preflight", "register",
           "strict", "uninstall"]
