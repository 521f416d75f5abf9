"""Leaf names shared by the parity plugin's modules: where records go, the artifact schema and its one
atomic JSON write, and the provider table.

Why a leaf: ``gate``, ``routing``, ``artifact``, ``profile`` and ``plugin`` all need these, and with each
living in one of them they imported each other in a circle (gate <-> artifact, gate <-> routing,
profile <-> plugin). This module imports nothing of the plugin.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

#: where the per-rank gate records go; set by ``unirl_worker_env`` (absolute) for remote ranks
DIR_ENV = "UNIRL_PARITY_DIR"
SCHEMA = "unirl.parity.artifact/v1"
#: the parity providers, by the model adapter's ``parity_adapter`` name (lazy factories)
PROVIDERS: dict[str, str] = {"qwen3": "unirl_parity_vllm.providers:Qwen3ParityProvider",
                             "qwen3_moe": "unirl_parity_vllm.moe:Qwen3MoeParityProvider"}


def parity_dir(config: Any) -> Path:
    env = os.environ.get(DIR_ENV)
    if env:
        return Path(env)
    return Path(config.run_dir).absolute() / "parity"


def write_json_atomic(path: Path | str, data: Any) -> Path:
    """Write ``data`` as JSON to ``path`` with core's one atomic write (:func:`unirl.api.atomic_write_json`)."""
    from unirl.api import atomic_write_json

    return atomic_write_json(path, data, indent=2, sort_keys=True, default=str)
