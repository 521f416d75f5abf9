"""``unirl agentic-data RECIPE [--force] [key=value ...]``: write the generated dataset files an environment's
recipe reads (``data.source`` / ``data.eval_source``) and, with ``word_tokenizer``, its tokenizer
(``model.tokenizer``).

Why a command: the search questions and the TextWorld games are generated from a seed, never shipped,
and core reads prompts from files. The files are a pure function of the recipe's environment section, so
writing them again gives the same bytes.

Why it claims its paths first: ``data.source`` may name the user's own data file and ``model.tokenizer`` a
tokenizer the user trained. Core's output rule (:mod:`unirl.outputs`) decides, before anything is
generated: a data file is replaced only when it is absent or exactly what an earlier agentic-data wrote
(noted with its sha256 beside it), the tokenizer directory only when it is absent, empty or an earlier
agentic-data tokenizer (its marker). ``--force`` overwrites the named data files and writes the
tokenizer beside a directory's other files (never over them). Everything is generated in a hidden
staging directory and moved into place at the end, so a failed run leaves the old files as they were."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

#: environment -> (its section under plugins.agentic, its options model)
DATA_ENVIRONMENTS = {
    "search": ("search", "unirl_agentic.search.corpus:CorpusOptions"),
    "textworld": ("textworld", "unirl_agentic.games.options:TextWorldOptions"),
}
#: the kind of UniRL output agentic-data writes (its data files' notes, its tokenizer directory's marker)
KIND = "agentic-data"
TOKENIZER_KIND = "agentic-data-tokenizer"
USAGE = "usage: unirl agentic-data RECIPE [--force] [key.sub=value ...]"


def _word_tokenizer(config: Any, env: str) -> bool:
    """The environment's ``word_tokenizer`` option, read through its own options model (so a bad value is
    the same error here as in a run)."""
    if env == "search":
        from unirl_agentic.search.tools import corpus_options

        return corpus_options(config).word_tokenizer
    from unirl_agentic.games.environment import textworld_options

    return textworld_options(config).word_tokenizer


def check_targets(config: Any, *, force: bool = False) -> tuple[Path, Path, Path | None]:
    """``(data.source, data.eval_source, model.tokenizer or None)`` after every check, or a ConfigError
    (one line: the field, the path and the fix) before anything is generated."""
    from unirl.api import ConfigError, claim_output_dir, claim_output_file, file_is_ours

    env = config.rollout.environment
    if env not in DATA_ENVIRONMENTS:
        raise ConfigError(f"rollout.environment is {env!r}: agentic-data writes the files of the "
                          f"{' and '.join(DATA_ENVIRONMENTS)} environments (fix: run it on such a recipe, e.g. "
                          "recipes/search-tiny.yaml, or set rollout.environment=search)")
    source, held = config.data.source, config.data.eval_source
    if not source or source == "arith" or not held:
        raise ConfigError("data.source / data.eval_source: agentic-data writes its files there (fix: set both "
                          "to .jsonl paths)")
    train, evals = Path(source), Path(held)
    if train.absolute() == evals.absolute():
        raise ConfigError(f"data.eval_source {evals}: the same file as data.source; the held-out split would "
                          "overwrite the training one (fix: give data.eval_source its own path)")
    for field, path in (("data.source", train), ("data.eval_source", evals)):
        claim_output_file(path, field=field, what="dataset file agentic-data", force=force,
                          is_ours=lambda p: file_is_ours(p, KIND))
    tok = None
    if _word_tokenizer(config, env):
        from unirl_agentic.word_tokenizer import word_tokenizer_unset

        unset = word_tokenizer_unset(config, DATA_ENVIRONMENTS[env][0])
        if unset is not None:
            raise ConfigError(f"{unset[0]} {unset[1]} (fix: {unset[2]})")
        tok = claim_output_dir(config.model.tokenizer, kind=TOKENIZER_KIND, field="model.tokenizer", force=force)
    return train, evals, tok


def write_data(config: Any, *, force: bool = False) -> tuple[Path, Path]:
    """Write ``data.source`` and ``data.eval_source`` (and the word tokenizer) for ``rollout.environment``,
    under the rule in the module docstring."""
    from unirl.api import (
        atomic_write,
        claim_output_file,
        file_is_ours,
        mark_output_dir,
        record_output_file,
        replace_output_dir,
    )

    train, evals, tok = check_targets(config, force=force)
    stage = train.absolute().parent / f".unirl-agentic-data-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)  # a crashed run of this pid; the name is ours
    stage.mkdir(parents=True)
    try:
        staged_tok = tok.absolute().parent / f".{tok.name}.unirl-agentic-data-{os.getpid()}" if tok else None
        update = {"model": config.model.model_copy(update={"tokenizer": str(staged_tok)})} if tok else {}
        if staged_tok is not None:
            shutil.rmtree(staged_tok, ignore_errors=True)
        if config.rollout.environment == "search":
            from unirl_agentic.search.environment import write_dataset
        else:
            from unirl_agentic.games.environment import write_dataset
        written = write_dataset(config.model_copy(update=update), stage)
        if staged_tok is not None:
            mark_output_dir(staged_tok, TOKENIZER_KIND)
            replace_output_dir(staged_tok, tok, kind=TOKENIZER_KIND, field="model.tokenizer", force=force)
        for field, path, new in (("data.source", train, written[0]), ("data.eval_source", evals, written[1])):
            claim_output_file(path, field=field, what="dataset file agentic-data", force=force,  # again: minutes
                              is_ours=lambda p: file_is_ours(p, KIND))  # passed, a file may have appeared
            atomic_write(path, new.read_bytes())
            record_output_file(path, KIND)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if tok is not None:
            shutil.rmtree(staged_tok, ignore_errors=True)
    return train, evals


def main(argv: list[str]) -> int:
    from unirl.api import load_config

    force = "--force" in argv
    argv = [a for a in argv if a != "--force"]
    if not argv or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    config = load_config(argv[0], argv[1:])
    train, held = write_data(config, force=force)
    print(f"wrote {train} ({sum(1 for _ in train.open())} rows) and {held} ({sum(1 for _ in held.open())} rows)")
    return 0
