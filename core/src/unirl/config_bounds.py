"""One rule for every number a user can set: finite, and within what its consumer accepts.

Why a module of its own: a ``gt=0`` bound lets ``.inf`` and ``.nan`` through (YAML spells both), and a
field without a bound is first checked by the library that reads it (AdamW, ``torch.manual_seed``,
the data cursor), after the model is built, as a traceback. :class:`StrictOptions` is the base of
every config model (RunConfig's sections and each plugin's options, through ``unirl.api.Options``):
it forbids unknown keys and refuses NaN and +-inf in every float field unless the field itself says
otherwise (``Field(allow_inf_nan=True)``). :func:`numeric_fields` walks a model so a test can check
that no numeric field was added without a bound, and :func:`nonfinite_values` is the kernel's safety
net for an options model that does not derive from the base.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

#: ``torch.manual_seed`` takes 64 bits; the run derives more seeds from ``run.seed`` by adding small
#: offsets (the SFT cursor's +1, the eval seed's +7919), so the largest seed leaves room for them.
SEED_MAX = 2**63 - 1 - 2**20


class StrictOptions(BaseModel):
    """The base of every config model: unknown keys and non-finite floats are errors at config time,
    in typed fields (pydantic's ``allow_inf_nan``) and in free-form ones (``model.build``, ``*.options``,
    ``plugins.<name>``: a NaN there reaches a component or a transformers config unchecked)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="after", check_fields=False)
    @classmethod
    def _finite_in_free_form_fields(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, BaseModel) or not isinstance(value, (dict, list, tuple)):
            return value  # a section checks itself; a typed number is pydantic's
        field = cls.model_fields.get(info.field_name or "")
        extra = field.json_schema_extra if field is not None and isinstance(field.json_schema_extra, dict) else {}
        if field is not None and (any(getattr(m, "allow_inf_nan", None) for m in field.metadata)
                                  or extra.get("finite_checked_by")):
            return value
        bad = nonfinite_values(value)
        if bad:
            at, v = bad[0]
            raise ValueError(f"{at} is {v!r}: NaN and infinity are not accepted here; fix: give a finite number")
        return value


_BOUNDS = ("ge", "gt", "le", "lt")


def _has_bound(metadata: Any) -> bool:
    return any(getattr(m, name, None) is not None for m in metadata for name in _BOUNDS)


def _items_bounded(ann: Any) -> bool:
    """Every number inside a container annotation carries its own bound (``tuple[Annotated[float,
    Field(ge=0, lt=1)], ...]``)."""
    if typing.get_origin(ann) is typing.Annotated:
        return _has_bound(m for meta in typing.get_args(ann)[1:] for m in (*getattr(meta, "metadata", ()), meta))
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    return bool(args) and all(_items_bounded(a) for a in args if _numeric(a) or _floats(a)
                              or typing.get_origin(a) is typing.Annotated)


def _bounded(info: Any) -> bool:
    """Whether a pydantic field declares a lower or upper bound (ge / gt / le / lt), on itself or on
    each number it holds, or says why it has none (``json_schema_extra={"unbounded": why}``)."""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    return _has_bound(info.metadata) or _items_bounded(info.annotation) or bool(extra.get("unbounded"))


def _args(ann: Any) -> tuple[Any, ...]:
    return typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,)


def _numeric(ann: Any) -> bool:
    """A field that holds a number: int or float, optional or not (bool and Literal are not numbers)."""
    return any(a in (int, float) for a in _args(ann))


def _floats(ann: Any) -> bool:
    """A field whose value holds floats anywhere: float, a tuple / list / dict of floats."""
    if ann is float:
        return True
    return any(_floats(a) for a in typing.get_args(ann) if a is not type(None))


def _models(ann: Any) -> list[type[BaseModel]]:
    return [a for a in _args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]


def numeric_fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, type[BaseModel], str, bool, bool]]:
    """``(dotted name, model, field name, holds floats, declares a bound)`` for every number-holding
    field of ``model`` and of the sections nested in it."""
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{name}"
        for sub in _models(info.annotation):
            yield from numeric_fields(sub, dotted + ".")
        if _numeric(info.annotation) or _floats(info.annotation):
            yield dotted, model, name, _floats(info.annotation), _bounded(info)


def nonfinite_values(value: Any, at: str = "") -> list[tuple[str, float]]:
    """``(dotted location, value)`` of every NaN / +-inf float in a validated model (recursively),
    skipping fields that declare ``allow_inf_nan=True``."""
    out: list[tuple[str, float]] = []
    if isinstance(value, float) and not math.isfinite(value):
        return [(at, value)]
    if isinstance(value, BaseModel):
        for name, info in type(value).model_fields.items():
            if any(getattr(m, "allow_inf_nan", None) for m in info.metadata):
                continue
            out += nonfinite_values(getattr(value, name), f"{at}.{name}" if at else name)
    elif isinstance(value, dict):
        for key, item in value.items():
            out += nonfinite_values(item, f"{at}.{key}" if at else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            out += nonfinite_values(item, f"{at}.{i}" if at else str(i))
    return out
