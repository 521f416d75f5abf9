"""``content.jsonl`` rows (``trace.options.include_content: true``): one scored Sample each, with its
structure, and the reader that rebuilds the Sample from a row.

Why the Parts and not the flat lists: a Sample's content *is* its Parts (role, turn, tokens, log-probs,
version, payload; ``Sample.from_parts`` rebuilds the flat per-token lists and spans from them), so a row
holds each token once, says which tokens the model produced and which an environment returned, and
survives a change of the hot-path layout. ``fork`` is the sample's place in the tree
(:func:`unirl.api.fork_point` of its path id: the parent trajectory, the turn it was forked before, the
branch), written out so a reader need not parse ids.

Rows written before schema 3 hold ``sample_id``, ``prompt_text`` and ``response_text`` only: they still
load as text (:func:`read_rows`), and :func:`sample_of` refuses them by name (there are no Parts to
rebuild a Sample from). Raw content is opt-in: token ids and text are never written by default.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from unirl.api import Part, Sample, fork_point

CONTENT_FILE = "content.jsonl"


def _payload(p: Part) -> tuple[Any, bool]:
    """The Part's payload when JSON can hold it exactly, else (None, True): dropped, and said so."""
    if p.payload is None:
        return None, False
    try:
        return json.loads(json.dumps(p.payload)), False
    except (TypeError, ValueError):
        return None, True


def content_row(s: Sample) -> dict[str, Any]:
    """One Sample as a ``content.jsonl`` row (the text fields of schema 2, plus its structure)."""
    fp = fork_point(s.id)
    parts = []
    for p in s.parts:
        payload, dropped = _payload(p)
        row: dict[str, Any] = {"role": p.role, "turn": p.turn, "tokens": list(p.tokens),
                               "logprobs": None if p.logprobs is None else list(p.logprobs), "version": p.version}
        if payload is not None:
            row["payload"] = payload
        if dropped:
            row["payload_dropped"] = type(p.payload).__name__  # not JSON: a reader gets None
        parts.append(row)
    return {
        "sample_id": s.id, "prompt_text": s.prompt_text, "response_text": s.response_text,
        "group_id": s.group_id, "fork": None if fp is None else {"parent": fp[0], "at_turn": fp[1], "branch": fp[2]},
        "parts": parts, "status": s.status, "finish_reason": s.finish_reason,
        "reward": None if math.isnan(s.reward) else s.reward, "seed": s.seed,
    }


def sample_of(row: dict[str, Any]) -> Sample:
    """The Sample a :func:`content_row` row was written from: its id (so its fork path), Parts, status,
    finish reason, reward, seed and texts. Request records and ``meta`` are not in the row."""
    if "parts" not in row:
        raise ValueError(f"content row of sample {row.get('sample_id')!r} holds text only (a trace written before "
                         "schema 3): it has no Parts to rebuild the sample from; fix: capture the run again with "
                         "this plugin version and trace.options.include_content: true")
    parts = [Part(p["role"], list(p["tokens"]), None if p["logprobs"] is None else list(p["logprobs"]),
                  p["version"], p["turn"], p.get("payload")) for p in row["parts"]]
    reward = math.nan if row["reward"] is None else float(row["reward"])
    return Sample.from_parts(row["sample_id"], parts, prompt_text=row["prompt_text"],
                             response_text=row["response_text"], status=row["status"],
                             finish_reason=row["finish_reason"], reward=reward, seed=row["seed"])


def read_rows(trace_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``trace_dir/content.jsonl`` as written (any schema)."""
    path = Path(trace_dir) / CONTENT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; content is written only with "
                                "trace.options.include_content: true")
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def read_samples(trace_dir: str | Path) -> list[Sample]:
    """Every sample of a trace's ``content.jsonl``, rebuilt (:func:`sample_of`), in capture order."""
    return [sample_of(r) for r in read_rows(trace_dir)]
