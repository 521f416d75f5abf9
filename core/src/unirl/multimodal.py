"""Images on prompts: loading and validating a dataset row's image, and the one shared reference a
prompt's samples carry (issue 71, vision-language models).

Why a module of its own: a :class:`~unirl.samples.Sample` is token ids plus Parts; an image is
neither. A prompt's images are loaded and checked once, before any model is built, into a
:class:`PromptImages` (frozen), and that one object rides in ``sample.meta[IMAGES_KEY]``.
:meth:`Sample.child` copies ``meta`` shallowly, so every sibling of a GRPO group points at the same
object: pixels are never copied per sibling. The pixel tensors the model's processor makes
(``pixel_values``, ``image_grid_thw``) are computed once per prompt and cached on that object.

Bad input raises :class:`~unirl.kernel.errors.DataError` with one line naming the row and the fix:
a missing, unreadable or too large image, an image column on a text-only model, and
``data.image_key`` naming no column.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unirl.kernel.errors import DataError

#: where a prompt's :class:`PromptImages` rides on a Sample (``sample.meta``)
IMAGES_KEY = "images"
#: the default ceiling on one image's pixels (width x height); larger images are refused, not resized
#: the key under which the adapter caches a prompt's processed images (``image_inputs``); the actor reads the
#: same entry (:mod:`unirl.actor.vision_inputs`), so one processor call serves the engine and the trainer
PROCESSED_KEY = "model_inputs"
MAX_PIXELS = 4096 * 4096


@dataclass(frozen=True, eq=False)
class PromptImages:
    """A prompt's images (PIL, RGB, in prompt order), shared by reference by all its samples.

    ``cache`` holds what a model's processor made of them (keyed by the processor's identity), so a
    group of ``n`` samples runs the image processor once, not ``n`` times."""

    images: tuple[Any, ...]
    cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.images)

    def processed(self, key: Any, make: Any) -> Any:
        """``make(self.images)``, computed once per ``key`` (the processor's identity)."""
        if key not in self.cache:
            self.cache[key] = make(self.images)
        return self.cache[key]


def load_image(value: Any, where: str, *, max_pixels: int = MAX_PIXELS, base: Path | None = None) -> Any:
    """One row's image as an RGB PIL image: ``value`` is a path (relative to ``base``), bytes, or a PIL
    image. ``where`` names the row in the error (``"train.jsonl row 3"``)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        img = value
    elif isinstance(value, (bytes, bytearray)):
        try:
            img = Image.open(io.BytesIO(bytes(value)))
            img.load()
        except (UnidentifiedImageError, OSError) as e:
            raise DataError(f"{where}: the image bytes are not a readable image ({e}); fix: store PNG/JPEG "
                            "bytes, a path, or a PIL image in the image column") from None
    elif isinstance(value, (str, Path)) and str(value):
        p = Path(value)
        if not p.is_absolute() and base is not None:
            p = base / p
        if not p.is_file():
            raise DataError(f"{where}: image file {str(p)!r} does not exist; fix: correct the path (relative "
                            "paths are read from the data file's directory) or drop the row")
        try:
            with Image.open(p) as f:
                f.load()
                img = f.copy()
        except (UnidentifiedImageError, OSError) as e:
            raise DataError(f"{where}: image file {str(p)!r} is not a readable image ({e}); fix: re-save it "
                            "as PNG or JPEG or drop the row") from None
    else:
        raise DataError(f"{where}: the image is {type(value).__name__} {value!r:.40}, not a path, bytes or a "
                        "PIL image; fix: put one of those in the image column")
    w, h = img.size
    if w * h > max_pixels:
        raise DataError(f"{where}: the image is {w}x{h} = {w * h} pixels, over the limit of {max_pixels}; "
                        "fix: downscale it before training or drop the row")
    if w < 1 or h < 1:
        raise DataError(f"{where}: the image is empty ({w}x{h}); fix: drop the row")
    return img.convert("RGB")


def row_images(row: dict[str, Any], image_key: str, where: str, *, vision: bool,
               max_pixels: int = MAX_PIXELS, base: Path | None = None) -> PromptImages | None:
    """The images of one dataset row under ``image_key`` (one value or a list), loaded and checked;
    None when the row has none. ``vision``: whether the model takes images (the adapter's trait)."""
    if image_key not in row:
        cols = ", ".join(sorted(map(str, row))) or "none"
        raise DataError(f"{where}: data.image_key {image_key!r} names no column (columns: {cols}); fix: set "
                        "data.image_key to the image column, or leave it unset for text-only data")
    value = row[image_key]
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return None
    if not vision:
        raise DataError(f"{where}: the row has an image but the model takes text only; fix: use a "
                        "vision-language adapter (model.adapter: qwen2_5_vl) or unset data.image_key")
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return PromptImages(tuple(load_image(v, where, max_pixels=max_pixels, base=base) for v in values))


def images_of(sample: Any) -> PromptImages | None:
    """The images a sample's prompt carries (None: a text prompt)."""
    return sample.meta.get(IMAGES_KEY)


def attach_images(sample: Any, images: PromptImages | None) -> None:
    """Put ``images`` on ``sample`` (its children share the reference, see the module doc)."""
    if images is not None:
        sample.meta[IMAGES_KEY] = images
