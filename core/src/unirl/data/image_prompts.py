"""``data.image_key``: each dataset row's images, read, checked and attached to its prompt (issue 71).

Why a module of its own: :mod:`unirl.data.datasets` reads prompt and answer columns for every kind of
source; images are an optional third column that only a vision-language adapter (``ModelAdapter.vision``)
takes, and their checks (missing / unreadable / too large file, image on a text-only model, a key naming
no column) are :mod:`unirl.multimodal`'s. Every bad row is reported in one :class:`DataError` line that
names the row and the fix, before a prompt is handed to an engine.

A row with images becomes a chat prompt whose user turn is one ``{"type": "image"}`` item per image and
the row's text; the adapter renders it with its template and expands each placeholder to its image's token
count (``adapter.prompt_ids``). Relative image paths are read from the data file's directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from unirl.kernel.errors import DataError
from unirl.multimodal import MAX_PIXELS, attach_images, row_images

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import RunConfig
    from unirl.samples import Sample


def image_rows(path: Path, split: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file or a ``save_to_disk`` directory
    (its ``split``), with their labels (``line K`` for JSON Lines, ``row K`` otherwise). Read after
    :mod:`unirl.data.datasets` has read and checked the same source, so its format errors are reported there."""
    if path.suffix.lower() == ".jsonl":
        import json

        rows, labels = [], []
        for k, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                rows.append(json.loads(line))
                labels.append(f"line {k}")
        return rows, labels
    import datasets

    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    else:
        builder = {".json": "json", ".parquet": "parquet", ".csv": "csv"}[path.suffix.lower()]
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    return [dict(r) for r in ds], [f"row {i + 1}" for i in range(len(ds))]


def with_row_images(samples: list[Sample], config: RunConfig, tokenizer: Any, split: str,
                    adapter: Any = None) -> list[Sample]:
    """``samples`` (ids ``p{row}``) with each row's images attached and its prompt re-rendered around
    them; unchanged without ``data.image_key``. ``adapter``: the run's model adapter (its ``vision``
    trait, processor and template)."""
    data = config.data
    if data.image_key is None:
        return samples
    source = data.source if split == "train" else data.eval_source
    if source == "arith" or source is None:
        raise DataError("data.image_key is set but the prompts are the built-in arith generator (no images); "
                        "fix: point data.source / data.eval_source at a file with an image column")
    path = Path(str(source)).expanduser()
    if not path.exists():
        raise DataError(f"data.image_key needs a local file or save_to_disk directory, not {source!r}; fix: "
                        "export the dataset with its image column to a .jsonl / .parquet file")
    vision = bool(adapter is not None and adapter.vision)
    rows, labels = image_rows(path, data.train_split if split == "train" else data.eval_split)
    base = path.parent if path.is_file() else path
    processor = adapter.image_processor(config) if vision else None
    by_row = {f"p{i}": i for i in range(len(rows))}
    for s in samples:
        i = by_row[s.id]
        images = row_images(rows[i], data.image_key, f"{source} {labels[i]}", vision=vision,
                            max_pixels=MAX_PIXELS, base=base)
        if images is None:
            continue
        content = [*({"type": "image"} for _ in images.images), {"type": "text", "text": s.prompt_text}]
        messages = ([{"role": "system", "content": data.system_prompt}] if data.system_prompt else []) + \
            [{"role": "user", "content": content}]
        s.prompt_ids = adapter.prompt_ids(tokenizer, processor, messages, images)
        attach_images(s, images)
    return samples
