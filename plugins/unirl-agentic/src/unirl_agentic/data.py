"""``unirl agentic-data RECIPE [key=value ...]``: write the generated dataset files an environment's recipe
reads (``data.source`` / ``data.eval_source``).

Why a command: the search questions and the TextWorld games are generated from a seed, never shipped,
and core reads prompts from files. The files are a pure function of the recipe's environment section, so
writing them again gives the same bytes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

#: environment -> (its section under plugins.agentic, its options model)
DATA_ENVIRONMENTS = {
    "search": ("search", "unirl_agentic.search.corpus:CorpusOptions"),
    "textworld": ("textworld", "unirl_agentic.games.options:TextWorldOptions"),
}


def write_data(config: Any) -> tuple[Path, Path]:
    """Write ``data.source`` and ``data.eval_source`` for ``rollout.environment``."""
    env = config.rollout.environment
    if env not in DATA_ENVIRONMENTS:
        raise ValueError(f"rollout.environment is {env!r}: agentic-data writes the files of "
                         f"{', '.join(DATA_ENVIRONMENTS)} (fix: run it on such a recipe)")
    if not config.data.source or config.data.source == "arith" or not config.data.eval_source:
        raise ValueError("agentic-data writes to data.source and data.eval_source: set both to .jsonl paths")
    if env == "search":
        from unirl_agentic.search.environment import write_dataset
    else:
        from unirl_agentic.games.environment import write_dataset
    return write_dataset(config)


def main(argv: list[str]) -> int:
    from unirl.api import load_config

    if not argv:
        print("usage: unirl agentic-data RECIPE [key.sub=value ...]", file=sys.stderr)
        return 2
    config = load_config(argv[0], argv[1:])
    train, held = write_data(config)
    print(f"wrote {train} ({sum(1 for _ in train.open())} rows) and {held} ({sum(1 for _ in held.open())} rows)")
    return 0
