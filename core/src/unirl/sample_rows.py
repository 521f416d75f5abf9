"""A :class:`~unirl.samples.Sample` as one JSON object, and back: what a file written outside a
checkpoint (a rollout trace's content, ``unirl eval``'s per-prompt JSONL) stores of a sample.

Why the Parts and not the flat per-token lists: a Sample's content *is* its Parts (role, turn, tokens,
log-probs, version, payload); :meth:`Sample.from_parts` rebuilds the flat lists and spans from them. A
row holds each token once, says which tokens the model produced and which an environment returned, and
outlives a change of the hot-path layout. ``fork`` is the sample's place in the tree
(:func:`~unirl.samples.fork_point` of its path id), written out so a reader need not parse ids.
Request records and ``meta`` are not part of a row (timings belong to a trace's own rows).
"""

from __future__ import annotations

import json
import math
from typing import Any

from unirl.kernel.errors import SampleError
from unirl.samples import Part, Sample, fork_point


def _payload(p: Part) -> tuple[Any, str | None]:
    """The Part's payload when JSON holds it exactly, else ``(None, its type name)``: dropped, and said so."""
    if p.payload is None:
        return None, None
    try:
        return json.loads(json.dumps(p.payload)), None
    except (TypeError, ValueError):
        return None, type(p.payload).__name__


def sample_row(s: Sample) -> dict[str, Any]:
    """``s`` as a JSON-ready dict: id, group, fork, Parts, status, finish reason, reward (None for a
    failed sample's NaN), seed, texts."""
    fp = fork_point(s.id)
    parts = []
    for p in s.parts:
        payload, dropped = _payload(p)
        row: dict[str, Any] = {"role": p.role, "turn": p.turn, "tokens": list(p.tokens),
                               "logprobs": None if p.logprobs is None else list(p.logprobs), "version": p.version}
        if payload is not None:
            row["payload"] = payload
        if dropped:
            row["payload_dropped"] = dropped  # not JSON: a reader gets None
        parts.append(row)
    return {
        "sample_id": s.id, "group_id": s.group_id,
        "fork": None if fp is None else {"parent": fp[0], "at_turn": fp[1], "branch": fp[2]},
        "parts": parts, "status": s.status, "finish_reason": s.finish_reason,
        "reward": None if math.isnan(s.reward) else s.reward, "seed": s.seed,
        "prompt_text": s.prompt_text, "response_text": s.response_text,
    }


def sample_from_row(row: dict[str, Any]) -> Sample:
    """The Sample :func:`sample_row` wrote (``Sample.from_parts``): equal to the original in id, Parts,
    flat lists, spans, status, finish reason, reward, seed and texts."""
    if "parts" not in row:
        raise SampleError(f"row of sample {row.get('sample_id')!r} has no 'parts' (text only, written before "
                          "samples were exported with their Parts): it cannot be rebuilt into a Sample")
    parts = [Part(p["role"], list(p["tokens"]), None if p["logprobs"] is None else list(p["logprobs"]),
                  p["version"], p["turn"], p.get("payload")) for p in row["parts"]]
    reward = math.nan if row.get("reward") is None else float(row["reward"])
    return Sample.from_parts(row["sample_id"], parts, prompt_text=row.get("prompt_text", ""),
                             response_text=row.get("response_text", ""), status=row["status"],
                             finish_reason=row["finish_reason"], reward=reward, seed=row.get("seed"))
