"""Where an environment's word tokenizer (``plugins.agentic.<section>.word_tokenizer``) is written:
``model.tokenizer``. One check, read by ``unirl agentic-data`` (which raises) and by the plugin's preflight
(a violation), for every environment that has the option."""

from __future__ import annotations

from typing import Any


def word_tokenizer_unset(config: Any, section: str) -> tuple[str, str, str] | None:
    """``(field, problem, fix)`` when ``plugins.agentic.<section>.word_tokenizer`` is on without a
    ``model.tokenizer`` to write it to; None when there is one. Read by agentic-data and by preflight."""
    if config.model.tokenizer:
        return None
    return (f"plugins.agentic.{section}.word_tokenizer", "is true but model.tokenizer is not set: that is where "
            "agentic-data writes the word tokenizer", "set model.tokenizer to a directory (e.g. beside data.source)")


def tokenizer_dir(config: Any, section: str) -> str:
    """Where ``<section>.word_tokenizer`` is written: ``model.tokenizer``, or the error naming both fields."""
    unset = word_tokenizer_unset(config, section)
    if unset is not None:
        field, problem, fix = unset
        raise ValueError(f"{field} {problem}; fix: {fix}")
    return str(config.model.tokenizer)
