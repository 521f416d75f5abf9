"""The ``unirl.plugins`` entry point of ``unirl-trackers``.

Registers the trackers ``wandb``, ``mlflow`` and ``trackio`` (lazy strings: neither library is imported to list
them) and, in preflight, names the pip command when a listed tracker's library is not installed:
that is found before the model is built, not at the first logged step.
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
    return out
