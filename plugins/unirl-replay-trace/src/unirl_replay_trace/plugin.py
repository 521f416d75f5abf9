"""The ``unirl.plugins`` entry point of ``unirl-replay-trace`` (``replay_trace``).

Loading it imports nothing heavy: the exporters and the ``unirl trace`` command are lazy strings, and
Dynamo is imported only by ``unirl trace replay``. Default-off: nothing is captured unless
``trace.exporter`` names one of the exporters below.
"""

from __future__ import annotations

from typing import Any

from unirl.api import hookimpl

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
