"""The weight fingerprint of each published version, as the receipts reported it.

Why a small registry: the trace exporter sees ``(phase, step, version, samples)`` but not the
fingerprint of the weights that version names. The kernel's ``unirl_on_weights_published`` hook sees
the receipts (every worker's sha256 of what it loaded, checked equal before the commit). Both run in
the trainer's process, so the hook files the fingerprint here under the run directory and the
exporter looks it up. A version never published in this process (a run's version 0, before the first
publish) has no fingerprint: the trace says ``null``, never a guess.
"""

from __future__ import annotations

from typing import Any

_BY_RUN: dict[str, dict[int, str]] = {}


def remember(config: Any, version: int, receipts: list[Any]) -> None:
    fps = {r.fingerprint for r in receipts}
    if len(fps) == 1:  # a committed version: every receipt agreed (the ledger checked)
        _BY_RUN.setdefault(str(config.run_dir), {})[int(version)] = fps.pop()


def fingerprint_of(config: Any, version: int) -> str | None:
    return _BY_RUN.get(str(config.run_dir), {}).get(int(version))
