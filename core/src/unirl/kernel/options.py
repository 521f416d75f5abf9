"""A component's options: declared once, by the component, and validated once, by the kernel.

A factory declares the pydantic model of its options section (``rollout.options``, ``actor.options``,
``weight_sync.options``, ``trace.options``, ``logging.options.<name>``, ``algorithm.estimator_options``)
as its ``Config`` attribute. :meth:`unirl.kernel.manager.Kernel.build` validates the raw section
against it here and hands the factory the validated object, so no component parses its own options.

Why one place: preflight and every component used to validate the same dict, each its own way, so a
bad option could be reported twice, by two sources, with two field styles. Preflight now reports what
this module finds (:class:`~unirl.kernel.errors.OptionsError`'s violations), and a build without
preflight raises the same error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unirl.kernel.errors import OptionsError, Violation, violations_from

if TYPE_CHECKING:  # pydantic is imported when options are validated: the kernel imports only pluggy
    from pydantic import BaseModel


def options_model(factory: Any) -> type[BaseModel] | None:
    """The pydantic model ``factory`` declares as ``Config`` (None: it takes no options)."""
    from pydantic import BaseModel

    model = getattr(factory, "Config", None)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def validate_options(factory: Any, raw: Any, *, name: str, source: str, field: str) -> BaseModel | None:
    """``raw`` validated against ``factory``'s options model (None when it declares none and ``raw``
    is empty). Raises :class:`OptionsError`, one violation per bad field named ``<field>.<loc>`` and
    sourced to ``source`` (the distribution that registered ``name``). A NaN or infinite float is
    refused whatever the model's own config says (unless its field declares ``allow_inf_nan=True``):
    the one finite-number rule (:mod:`unirl.config_bounds`) covers every component's options."""
    model = options_model(factory)
    if model is None:
        if raw:
            raise OptionsError([Violation(source, field, f"'{name}' takes no options, got {sorted(raw)}",
                                          "remove them")])
        return None
    from pydantic import ValidationError

    try:
        value = model.model_validate(dict(raw or {}))
    except ValidationError as exc:
        raise OptionsError(violations_from(exc, source, field,
                                           f"options of '{name}': {', '.join(model.model_fields)}")) from None
    from unirl.config_bounds import nonfinite_values

    bad = nonfinite_values(value)  # the finite-number rule, for a model not built on unirl.api.StrictOptions
    if bad:
        raise OptionsError([Violation(source, f"{field}.{at}", f"NaN and infinity are not accepted here (got {v!r})",
                                      "give a finite number") for at, v in bad])
    return value
