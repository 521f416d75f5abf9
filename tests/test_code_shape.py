"""The repository's shape, checked mechanically: pages that stay readable, walls that stay up.

Why: these rules (issue 72) drift one commit at a time, and nobody re-reads 85 KB of notes or the import
graph by hand. Each test reads files only (``ast``, text), so the whole module runs in about a second.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

#: the longest table cell the benchmarks' results page may hold: a cell is a figure, not a notebook
MAX_CELL = 300


def table_cells(text: str) -> list[tuple[int, str]]:
    """(line number, cell) for every cell of every markdown table row (``\\|`` is not a separator)."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        row = line.strip()
        if row.startswith("|") and row.endswith("|"):
            out += [(n, c.strip()) for c in re.split(r"(?<!\\)\|", row)[1:-1]]
    return out


def test_benchmark_results_page_has_short_cells():
    cells = table_cells((BENCH / "README.md").read_text())
    assert len(cells) > 100
    long = [f"benchmarks/README.md:{n}: {len(c)} chars: {c[:60]}..." for n, c in cells if len(c) > MAX_CELL]
    assert not long, f"table cells over {MAX_CELL} chars (move the history to benchmarks/HISTORY.md):\n" \
        + "\n".join(long)


def test_every_benchmark_script_has_a_section_and_an_index_row():
    """A user finds any benchmark's current figure from the index at the top."""
    page = (BENCH / "README.md").read_text()
    index = page.split("\n## ", 2)[1]
    assert index.startswith("Index")
    sections = set(re.findall(r"^## (\S+\.py)", page, flags=re.M))
    scripts = {p.name for p in BENCH.glob("*.py")}
    assert scripts - sections == set(), "benchmarks without a section in benchmarks/README.md"
    assert {s for s in scripts if f"[{s}](#" not in index} == set(), "benchmarks missing from the index"


def test_benchmark_history_is_newest_first():
    """Within each benchmark's section of HISTORY.md, dated entries run from the newest down."""
    text = (BENCH / "HISTORY.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) > 20
    for section in sections:
        dates = re.findall(r"^- \*\*(\d{4}-\d{2}-\d{2})", section, flags=re.M)
        assert dates == sorted(dates, reverse=True), f"{section.splitlines()[0]}: entries not newest first: {dates}"
