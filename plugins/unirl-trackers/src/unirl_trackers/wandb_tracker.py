"""Weights & Biases (``logging.trackers: [wandb]``).

One W&B run per UniRL run: its id is the run directory's name, so a resumed run (``run.resume``)
continues the same W&B run instead of starting a second one. ``mode: offline`` (or the usual
``WANDB_MODE=offline``) writes everything under ``dir`` for a later ``wandb sync``; the tests run so.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from unirl.api import Tracker


class WandbOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    project: str = Field("unirl", description="W&B project")
    entity: str | None = Field(None, description="W&B entity (team or user); None: the account's default")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="None: W&B's own default (WANDB_MODE, else online)")
    dir: str | None = Field(None, description="where W&B writes its files; None: the run directory")
    tags: list[str] = Field(default_factory=list)
    group: str | None = None


class WandbTracker(Tracker):
    Config = WandbOptions

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        import wandb

        o: WandbOptions = self.options
        run_id = re.sub(r"[^A-Za-z0-9_-]", "-", self.config.run.name)
        self.run = wandb.init(project=o.project, entity=o.entity, mode=o.mode, dir=o.dir or str(self.run_dir),
                              name=self.config.run.name, id=run_id, resume="allow", config=self.params,
                              tags=o.tags or None, group=o.group, reinit="create_new")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_artifact(self, path: Path) -> None:
        self.run.save(str(path), base_path=str(path.parent), policy="now")

    def close(self) -> None:
        self.run.finish()
