"""Preflight's image rules (issue 71): a vision-language run's data and model checked before anything is
built, one :class:`~unirl.kernel.errors.Violation` per broken rule, naming the field and the fix.

Why a table: each rule is (field, check, fix), and a new one is a row, not another branch in preflight.
A check reads the config and the adapter's declared traits (``vision``, ``vision_prefix``), never a
model's name, and returns the problem in words or None. What needs every row read (a missing or
unreadable image file) stays with the loader (:mod:`unirl.data.image_prompts`); here the first row of a
JSON Lines source is read to check that ``data.image_key`` names a column.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unirl.kernel.errors import Violation

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import RunConfig

CORE = "unirl-core"


def _text_only_adapter(config: RunConfig, adapter: Any) -> str | None:
    if config.data.image_key and not adapter.vision:
        return (f"data.image_key {config.data.image_key!r} is set but model.adapter {config.model.adapter!r} takes "
                "text only (it declares no vision)")
    return None


def _freeze_without_tower(config: RunConfig, adapter: Any) -> str | None:
    if "vision" in config.actor.freeze and not (adapter.vision and adapter.vision_prefix):
        return f"actor.freeze: [vision] but model.adapter {config.model.adapter!r} has no vision tower"
    return None


def _no_image_source(config: RunConfig, adapter: Any) -> str | None:
    d = config.data
    if d.image_key and d.source in (None, "arith"):
        return "data.image_key is set but the prompts are the built-in arith generator (no images)"
    return None


def _checkpoint_without_processor(config: RunConfig, adapter: Any) -> str | None:
    m = config.model
    if config.data.image_key and adapter.vision and m.path and Path(str(m.path)).is_dir() \
            and not Path(str(m.path), "preprocessor_config.json").is_file():
        return (f"model.path {m.path} has no preprocessor_config.json: the image processor (resizing, "
                "patching) would fall back to the tiny demo's pixel budget, not the checkpoint's")
    return None


def _key_names_no_column(config: RunConfig, adapter: Any) -> str | None:
    d = config.data
    for field, source in (("data.source", d.source), ("data.eval_source", d.eval_source)):
        if not d.image_key or not source or not str(source).endswith(".jsonl") or not Path(str(source)).is_file():
            continue
        with open(str(source), encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), None)
        try:
            row = json.loads(first) if first else None
        except json.JSONDecodeError:
            continue  # the data rules report a file that is not JSON Lines
        if isinstance(row, dict) and d.image_key not in row:
            cols = ", ".join(sorted(map(str, row))) or "none"
            return f"data.image_key {d.image_key!r} names no column of {field} {source} (columns: {cols})"
    return None


#: (field, check, fix): the image rules, in the order they are reported
RULES: tuple[tuple[str, Callable[[Any, Any], str | None], str], ...] = (
    ("data.image_key", _text_only_adapter, "use a vision-language adapter (model.adapter: qwen2_5_vl) or unset "
                                           "data.image_key"),
    ("actor.freeze", _freeze_without_tower, "remove 'vision' from actor.freeze or use a vision-language adapter"),
    ("data.image_key", _no_image_source, "point data.source / data.eval_source at a file with an image column"),
    ("model.path", _checkpoint_without_processor, "save the model's processor beside it "
                                                  "(processor.save_pretrained(model.path))"),
    ("data.image_key", _key_names_no_column, "set data.image_key to the image column, or unset it for text-only "
                                             "data"),
)


def image_violations(config: RunConfig, adapter: Any) -> list[Violation]:
    """Every image rule ``config`` breaks with ``adapter`` (an instance: its traits are read)."""
    out = []
    for field, rule, fix in RULES:
        problem = rule(config, adapter)
        if problem:
            out.append(Violation(CORE, field, problem, fix))
    return out
