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
def unirl_on_weights_published(version: int, receipts: list, config: Any, started_ms: float,
                               ended_ms: float) -> None:
    """Files the version's fingerprint and the sync's window (an async or stream trace replays it as a
    pause in its one arrival stream)."""
    if config.trace.exporter not in EXPORTERS:
        return  # default-off: keep nothing
    from unirl_replay_trace.fingerprints import remember
    from unirl_replay_trace.stream_trace import remember_sync

    remember(config, version, receipts)
    remember_sync(config, version, started_ms, ended_ms)


@hookimpl
def unirl_preflight(config: Any) -> list[Violation]:
    """What a capture cannot replay, said before training rather than at close. Async and stream runs
    are captured (one arrival stream, :mod:`unirl_replay_trace.stream_trace`); partial rollout is not."""
    exporter = config.trace.exporter
    if exporter not in EXPORTERS:
        return []
    return _partial_rollout(config, exporter)


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
