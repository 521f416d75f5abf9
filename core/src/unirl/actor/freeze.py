"""``actor.freeze``: parts of the model that do not train (issue 71: ``[vision]``, a vision-language
model's vision tower, the common choice when RL tunes only the language model).

Why by ``requires_grad``: every actor's optimizer steps only the parameters that require grad
(``skeleton.train_params``), so a frozen part gets no gradient, no optimizer state and no update. The
part is found by the adapter's declared ``vision_prefix``, never by a model's name; an adapter without
a vision tower is refused naming the field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unirl.kernel.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch


def freeze_parts(model: torch.nn.Module, adapter: Any, parts: list[str]) -> list[str]:
    """Turn off ``requires_grad`` for ``parts`` of ``model``; the names frozen."""
    if "vision" not in parts:
        return []
    if not adapter.vision or not adapter.vision_prefix:
        raise ConfigError(f"actor.freeze: [vision] but model.adapter {adapter.name!r} has no vision tower; fix: "
                          "remove 'vision' from actor.freeze or use a vision-language adapter")
    names = []
    for name, p in model.named_parameters():
        if name.startswith(adapter.vision_prefix):
            p.requires_grad_(False)
            names.append(name)
    return names
