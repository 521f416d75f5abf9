"""MLflow (``logging.trackers: [mlflow]``), through ``MlflowClient`` so nothing global (the active run,
the tracking URI of the process) is touched.

``tracking_uri`` unset writes a local store: ``RUN_DIR/mlflow.db`` (SQLite) with the artifacts under
``RUN_DIR/mlartifacts`` (``mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db`` shows it); the
tests read the metrics back from that store. Why SQLite and not the ``./mlruns`` directory store: MLflow
3 put the file store in maintenance mode and refuses it unless ``MLFLOW_ALLOW_FILE_STORE=true``
(``tracking_uri: file:...`` still works with that variable set). A resumed run continues the MLflow
run it started (its id is kept in ``RUN_DIR/mlflow_run_id``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from unirl.api import Tracker

#: MLflow accepts alphanumerics, underscores, dashes, periods, spaces, slashes (and colons) in a key
_BAD_KEY = re.compile(r"[^A-Za-z0-9_\-. /:]")
#: one log_batch holds at most 100 params and 1000 metrics; a param value at most 6000 characters
_PARAMS_PER_BATCH, _PARAM_VALUE_MAX = 100, 6000


def local_store(run_dir: Path) -> str:
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def mlflow_key(key: str) -> str:
    return _BAD_KEY.sub("_", key)


class MlflowOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tracking_uri: str | None = Field(None, description="None: a local SQLite store at RUN_DIR/mlflow.db, "
                                     "artifacts in RUN_DIR/mlartifacts")
    experiment: str = Field("unirl", description="experiment name (created when missing)")


class MlflowTracker(Tracker):
    Config = MlflowOptions

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from mlflow import MlflowClient
        from mlflow.entities import Param

        o: MlflowOptions = self.options
        local = o.tracking_uri is None
        self.uri = o.tracking_uri or local_store(self.run_dir)
        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(o.experiment)
        artifacts = (self.run_dir / "mlartifacts").resolve().as_uri() if local else None
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
            o.experiment, artifact_location=artifacts)
        id_file = self.run_dir / "mlflow_run_id"
        if self.resume_step is not None and id_file.is_file():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            return  # params are immutable in MLflow, and the resumed run's are the same
        self.run_id = self.client.create_run(exp_id, run_name=self.config.run.name).info.run_id
        id_file.write_text(self.run_id + "\n")
        params = [Param(mlflow_key(k), str(v)[:_PARAM_VALUE_MAX]) for k, v in sorted(self.params.items())]
        for i in range(0, len(params), _PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + _PARAMS_PER_BATCH])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(k), v, now, step) for k, v in metrics.items()])

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
