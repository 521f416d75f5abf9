"""``content.jsonl`` rows (``trace.options.include_content: true``): one scored Sample each, with its
structure, and the reader that rebuilds the Samples.

A row is core's :func:`unirl.api.sample_row` (the Parts: role, turn, tokens, log-probs, version,
payload; the fork path; status, reward, seed; the texts), so a trace's content and ``unirl eval``'s
per-prompt samples are one format. Rows written before schema 3 hold ``sample_id``, ``prompt_text`` and
``response_text`` only: they still load as text (:func:`read_rows`), and :func:`read_samples` refuses
them by name (there are no Parts to rebuild a Sample from). Raw content is opt-in: token ids and text
are never written by default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unirl.api import Sample, SampleError, sample_from_row, sample_row

CONTENT_FILE = "content.jsonl"


def content_row(s: Sample) -> dict[str, Any]:
    """One Sample as a ``content.jsonl`` row (the text fields of schema 2 are among its keys)."""
    return sample_row(s)


def sample_of(row: dict[str, Any]) -> Sample:
    """The Sample a :func:`content_row` row was written from (request records and ``meta`` aside)."""
    try:
        return sample_from_row(row)
    except SampleError as exc:
        raise ValueError(f"content.jsonl: {exc}; this row holds text only (a trace written before schema 3); "
                         "fix: capture the run again with this plugin version and "
                         "trace.options.include_content: true") from exc


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
