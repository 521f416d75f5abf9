"""The ``unirl.plugins`` entry point of ``unirl-replay-trace`` (``replay_trace``).

Loading it imports nothing heavy: the exporters and the ``unirl trace`` command are lazy strings, and
Dynamo is imported only by ``unirl trace replay``. Default-off: nothing is captured unless
``trace.exporter`` names one of the exporters below.
"""

from __future__ import annotations

from typing import Any

from unirl.api import Violation, hookimpl

SOURCE = "unirl-replay-trace"
EXPORTERS = {"dynamo-agentic": "unirl_replay_trace.exporter:DynamoAgenticExporter",
             "mooncake": "unirl_replay_trace.exporter:MooncakeExporter"}


@hookimpl
def unirl_trace_exporters() -> dict[str, str]:
    return dict(EXPORTERS)


@hookimpl
def unirl_commands() -> dict[str, str]:
    """``unirl trace replay RUN_DIR`` (core's CLI dispatches the ``trace`` command here)."""
    return {"trace": "unirl_replay_trace.cli:main"}


@hookimpl
def unirl_on_weights_published(version: int, receipts: list, config: Any) -> None:
    if config.trace.exporter not in EXPORTERS:
        return  # default-off: keep nothing
    from unirl_replay_trace.fingerprints import remember

    remember(config, version, receipts)


@hookimpl
def unirl_preflight(config: Any) -> list[Violation]:
    """An async run cannot give a replayable trace: say so before training, not after it.

    Why: each rollout batch replays from its own barrier (see :mod:`unirl_replay_trace.formats`); with
    ``rollout.mode: async`` the engine generates while the trainer trains, so batches overlap in time
    and every format would drop that overlap. The exporter rejects such a trace at close, which used to
    be the first the user heard of it, after the whole run."""
    exporter = config.trace.exporter
    if exporter not in EXPORTERS:
        return []
    out = _partial_rollout(config, exporter)
    if config.rollout.mode == "sync":
        return out
    return out + [Violation(
        SOURCE, "trace.exporter",
        f"{exporter!r} cannot capture a rollout.mode={config.rollout.mode} run: its rollout batches overlap in "
        f"time, which no trace format ({', '.join(EXPORTERS)}) can replay, so the trace would be rejected "
        "when training ends",
        "set rollout.mode=sync to capture a replayable trace, or unset trace.exporter to train async "
        "without one")]


def _partial_rollout(config: Any, exporter: str) -> list[Violation]:
    """An agentic drive with partial rollout (``plugins.agentic.over_generate`` > 1) cannot be replayed
    as captured: a carried tail spans weight versions (the exporter rejects such a trace at close), and a
    dropped tail's requests loaded the engine but are in no batch (the replay would under-count the
    load). Read from the plain config section, so this plugin imports nothing of ``unirl-agentic``."""
    if getattr(config.rollout, "controller", None) != "agentic":
        return []
    over = (config.plugins.get("agentic") or {}).get("over_generate", 1.0)
    try:
        over = float(over)
    except (TypeError, ValueError):
        return []  # the agentic plugin's own preflight names a bad value
    if over <= 1.0:
        return []
    return [Violation(
        SOURCE, "plugins.agentic.over_generate",
        f"{exporter!r} cannot capture partial rollout (over_generate {over:g}): a carried tail spans weight "
        "versions, which no trace format replays, and a dropped tail's requests loaded the engine but belong "
        "to no batch", "set plugins.agentic.over_generate=1.0 for the captured run, or unset trace.exporter")]
