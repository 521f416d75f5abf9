"""unirl-replay-trace: capture rollout traces and replay them in Dynamo's trace simulator.

An optional, offline validation tool: not an engine, not a simulator, not a source of samples.
See ``docs/replay-trace.md``.
"""

from unirl_replay_trace.capture import SCHEMA, SCHEMA_VERSION, block_hashes

__all__ = ["SCHEMA", "SCHEMA_VERSION", "block_hashes"]
