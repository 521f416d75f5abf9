"""The ``unirl.plugins`` entry point of ``unirl-trackers``.

Registers the trackers ``wandb``, ``mlflow`` and ``trackio`` (lazy strings: neither library is imported to list
them) and, in preflight, names the pip command when a listed tracker's library is not installed, and
checks W&B's credentials and the MLflow server's reachability (:mod:`unirl_trackers.reachability`): each
is found before the model is built, not at the first logged step.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from unirl.api import Violation, hookimpl

SOURCE = "unirl-trackers"

#: tracker name -> (the module it imports, the extra that installs it)
LIBRARIES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow"), "trackio": ("trackio", "trackio")}


@hookimpl
def unirl_trackers() -> dict[str, str]:
    return {"wandb": "unirl_trackers.wandb_tracker:WandbTracker",
            "mlflow": "unirl_trackers.mlflow_tracker:MlflowTracker",
            "trackio": "unirl_trackers.trackio_tracker:TrackioTracker"}


@hookimpl
def unirl_preflight(config: Any) -> list[Violation]:
    out = []
    for i, name in enumerate(config.logging.trackers):
        if name in LIBRARIES and importlib.util.find_spec(LIBRARIES[name][0]) is None:
            out.append(Violation(SOURCE, f"logging.trackers[{i}]", f"tracker '{name}' needs the {LIBRARIES[name][0]} "
                                 "library, which is not installed",
                                 f"pip install 'unirl-trackers[{LIBRARIES[name][1]}]', or remove '{name}'"))
        elif name in REACHABILITY:
            problem = _reachability(config, name)
            if problem is not None:
                out.append(Violation(SOURCE, *problem))
    return out


#: tracker name -> (its options model, its check), as "module:attr" strings (nothing imported to list)
REACHABILITY = {"wandb": ("unirl_trackers.wandb_tracker:WandbOptions", "unirl_trackers.reachability:wandb_problem"),
                "mlflow": ("unirl_trackers.mlflow_tracker:MlflowOptions",
                           "unirl_trackers.reachability:mlflow_problem")}


def _reachability(config: Any, name: str) -> tuple[str, str, str] | None:
    """The tracker's credentials / server check on its validated options (bad options: core reports them)."""
    import importlib

    from pydantic import ValidationError

    def resolve(spec: str) -> Any:
        module, _, attr = spec.partition(":")
        return getattr(importlib.import_module(module), attr)

    model, check = (resolve(spec) for spec in REACHABILITY[name])
    try:
        options = model.model_validate(config.logging.options.get(name) or {})
    except ValidationError:
        return None
    return check(options, f"logging.options.{name}")
