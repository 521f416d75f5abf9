"""The one seeded build every model adapter uses: load ``model.path`` or build from a config under
``run.seed``, cast to ``model.dtype``, cache off.

Why one helper: the actor, the embedded engine and a server engine's start-up directory each build the
model from the same config and must get equal weights; a copy per adapter could drift (one seeding
the global RNG, one casting before building) and the engine would start from other weights than the
actor's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.config import RunConfig


def seeded_build(config: RunConfig, model_class: Any, hf_config: Any = None) -> torch.nn.Module:
    """``model_class.from_pretrained(model.path)`` when set, else ``model_class(hf_config())`` built under
    ``run.seed`` (the global RNG is left as it was); cast to ``model.dtype``, ``use_cache`` off.
    ``hf_config`` is a callable, called only for a build from scratch."""
    import torch

    dtype = getattr(torch, config.model.dtype)
    if config.model.path:
        model = model_class.from_pretrained(config.model.path, dtype=dtype)
    else:
        hf = hf_config()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.run.seed)
            model = model_class(hf)
        model = model.to(dtype)
    model.config.use_cache = False
    return model
