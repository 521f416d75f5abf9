"""Trackio (``logging.trackers: [trackio]``), Hugging Face's local-first tracker.

Trackio writes each project to a SQLite file under its data directory and needs no server or account
for that: ``trackio show`` opens the dashboard over the same file later. Its data directory is read
once, when the ``trackio`` module is first imported (``TRACKIO_DIR``, else ``$HF_HOME/trackio``), so
this tracker sets ``TRACKIO_DIR`` from ``dir`` before that import and refuses a ``dir`` that differs
from the one an earlier import already fixed (the metrics would land elsewhere, silently).

One Trackio run per UniRL run, named after it, opened with ``resume="allow"``: a resumed UniRL run
continues its Trackio run. ``space_id`` / ``server_url`` (Trackio's remote modes) are not exposed: they
need the network, and the tests here run offline.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from unirl.api import Tracker


class TrackioOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    project: str = Field("unirl", description="Trackio project (one SQLite file per project)")
    dir: str | None = Field(None, description="Trackio's data directory; None: TRACKIO_DIR, else $HF_HOME/trackio")
    group: str | None = Field(None, description="groups runs in the dashboard")
    system_metrics: bool = Field(False, description="Trackio's background CPU / RAM sampling thread")


def _data_dir(wanted: str | None) -> Path:
    """Fix Trackio's data directory before its first import (see the module doc) and return it."""
    if "trackio" in sys.modules:
        from trackio.utils import TRACKIO_DIR

        if wanted is not None and Path(wanted).resolve() != Path(TRACKIO_DIR).resolve():
            raise ValueError(f"logging.options.trackio.dir: trackio was already imported with its data directory "
                             f"{TRACKIO_DIR}; set TRACKIO_DIR={wanted} before the process starts, or leave dir unset")
        return Path(TRACKIO_DIR)
    if wanted is not None:
        os.environ["TRACKIO_DIR"] = str(Path(wanted).resolve())
    from trackio.utils import TRACKIO_DIR

    return Path(TRACKIO_DIR)


class TrackioTracker(Tracker):
    Config = TrackioOptions

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        o: TrackioOptions = self.options
        self.data_dir = _data_dir(o.dir)
        import trackio

        self.run = trackio.init(project=o.project, name=self.config.run.name, group=o.group, config=self.params,
                                resume="allow", embed=False, auto_log_cpu=o.system_metrics,
                                auto_log_gpu=o.system_metrics)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_artifact(self, path: Path) -> None:
        self.run.log_artifact(str(path), name=path.name)

    def close(self) -> None:
        self.run.finish()
