"""``rollout.options`` of the ``sglang`` engine and ``weight_sync.options`` of the ``sglang`` sync.

Kept apart from :mod:`unirl_sglang.engine` so preflight validates a recipe without importing torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from unirl.api import StrictOptions


class LaunchOptions(StrictOptions):
    """Start the servers ourselves: one ``python -m <module> --model-path .. --host .. --port ..`` per port."""

    model_config = ConfigDict(extra="forbid")

    module: str = Field("sglang.launch_server", description="the server module run with `python -m`")
    python: str | None = Field(None, description="interpreter; None: the trainer's own (sys.executable)")
    host: str = "127.0.0.1"
    ports: list[int] = Field(default_factory=lambda: [30000], min_length=1,
                             description="one server per port")
    args: list[str] = Field(default_factory=list,
                            description="extra server flags, e.g. ['--tp-size', '1', '--mem-fraction-static', '0.5']")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the server processes")
    startup_timeout_s: float = Field(600, gt=0, description="how long to wait for /health_generate")


class SGLangOptions(StrictOptions):
    """Engine options (``rollout.options.*`` when ``rollout.engine: sglang``)."""

    model_config = ConfigDict(extra="forbid")

    servers: list[str] = Field(default_factory=list,
                               description="base URLs of running servers, e.g. ['http://10.0.0.5:30000']")
    launch: LaunchOptions | None = Field(None, description="launch the servers instead (needs SGLang installed)")
    max_concurrency: int = Field(8, ge=1, description="most /generate requests in flight per server")
    max_batch: int = Field(64, ge=1, description="most seeded samples in one batched /generate request")
    request_timeout_s: float = Field(600, gt=0, description="read timeout of one HTTP request")
    retries: int = Field(4, ge=0, description="retries of a request after a connection error, then a clear error")
    backoff_s: float = Field(0.5, gt=0, description="first retry delay; doubles per retry")
    backoff_max_s: float = Field(8.0, gt=0, description="cap of the retry delay")
    health_timeout_s: float = Field(120, gt=0, description="how long /health_generate may take at start")
    original_logprobs: bool = Field(
        True, description="the servers run with SGLANG_RETURN_ORIGINAL_LOGPROB=1, so the returned log-probs "
        "are log_softmax of the raw logits (what the actor replays); False: after temperature")
    ignore_eos: bool = Field(False, description="never stop at EOS (benchmarks: fixed token counts)")
    export_dir: str | None = Field(None, description="where versioned weight directories are written; None: "
                                   "<run_dir>/sglang_weights. Servers must see it at the same path")
    keep_versions: int = Field(2, ge=1, description="exported versions kept on disk (the served one always)")

    @field_validator("servers")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"server {url!r} is not an http(s) URL (e.g. http://127.0.0.1:30000)")
        return [u.rstrip("/") for u in v]

    @model_validator(mode="after")
    def _where(self) -> SGLangOptions:
        if bool(self.servers) == (self.launch is not None):
            raise ValueError("give exactly one of rollout.options.servers (running servers) or "
                             "rollout.options.launch (start them)")
        return self

    def urls(self) -> list[str]:
        if self.launch is not None:
            return [f"http://{self.launch.host}:{p}" for p in self.launch.ports]
        return list(self.servers)


class SGLangSyncOptions(StrictOptions):
    """``weight_sync.options`` when ``weight_sync.name: sglang``."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["disk", "distributed"] = Field(
        "disk", description="disk: /update_weights_from_disk of a versioned safetensors directory; distributed: "
        "/update_weights_from_distributed over an NCCL group (GPU only; not run in this project's CI)")
    master_address: str = Field("127.0.0.1", description="distributed: the trainer's address, rank 0 of the group")
    master_port: int = Field(29555, ge=1, le=65535, description="distributed: the group's TCP store port")
    group_name: str = "unirl_weight_update"
    backend: Literal["nccl", "gloo"] = "nccl"
    server_world_size: int = Field(1, ge=1, description="distributed: GPUs (TP x DP ranks) of each server")
    bucket_mb: int = Field(512, ge=1, description="distributed: tensors per /update_weights_from_distributed call")
