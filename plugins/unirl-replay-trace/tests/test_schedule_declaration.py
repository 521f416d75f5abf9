"""The embedded engine's schedule as the replay reads it (issue 73, item 2): the engine merges queued
jobs into its running batch, and still declares no continuous batching, so a trace of it keeps its
per-request figures refused and the refusal says why (docs/replay-trace.md: measured on a merged stream
capture, per-request e2e 39.7 % off even at the best single speed, above the 35 % bar)."""

from __future__ import annotations

from unirl.api import Qwen3Adapter, RunConfig, build_demo_tokenizer, build_engine
from unirl_replay_trace.exporter import batching
from unirl_replay_trace.schedule import refusal


def test_the_merging_embedded_engine_declares_no_continuous_batching_and_the_replay_refuses():
    config = RunConfig.model_validate({"rollout": {"mode": "stream", "max_staleness": 1}})
    engine = build_engine(config, adapter=Qwen3Adapter(), tokenizer=build_demo_tokenizer())
    try:
        assert engine.merges_jobs  # it does merge jobs (unirl.engine.merged) ...
        assert engine.capabilities(config, engine.options).batching is None  # ... and declares no more
    finally:
        engine.close()
    assert batching(config) is None  # what the exporter writes into the manifest
    why = refusal({"provenance": {"engine": {"name": "torch", "batching": batching(config)}}})
    assert why is not None and "admits whole jobs, or runs a large one in static chunks" in why
    assert refusal({"provenance": {"engine": {"name": "vllm", "batching": "continuous"}}}) is None
