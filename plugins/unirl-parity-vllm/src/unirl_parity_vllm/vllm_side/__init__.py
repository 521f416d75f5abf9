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

from unirl_parity_vllm.vllm_side.settings import (
    ENTRY_POINT_NAME,
    PLATFORM_ENV,
    STRICT_ENV,
    TP_CACHE_ENV,
    platform,
    strict,
    tp_gather_cache,
)


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


__all__ = ["ENTRY_POINT_NAME", "PLATFORM_ENV", "STRICT_ENV", "TP_CACHE_ENV", "allowlist_problem", "install",
           "installed", "manifest", "platform", "preflight", "register", "strict", "tp_gather_cache", "uninstall"]
