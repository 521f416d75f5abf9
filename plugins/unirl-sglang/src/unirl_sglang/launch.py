"""Start and stop SGLang server processes (``rollout.options.launch``).

Each server is ``python -m sglang.launch_server --model-path DIR --host H --port P [args]``, with its
output in ``<run_dir>/sglang_server_<port>.log`` and, unless the recipe says otherwise,
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` so the returned log-probs are the raw ones the actor replays.
A server that exits before it is healthy fails the start with the tail of its log.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from unirl.api import UniRLError
from unirl_sglang.client import SGLangServer, SGLangUnavailableError
from unirl_sglang.options import LaunchOptions


class ServerProcesses:
    """The processes this engine started; :meth:`stop` ends them (and only them)."""

    def __init__(self, opts: LaunchOptions, model_dir: str, log_dir: Path, original_logprobs: bool) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        env = {**os.environ, **opts.env}
        env.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1" if original_logprobs else "0")
        log_dir.mkdir(parents=True, exist_ok=True)
        python = opts.python or sys.executable
        for port in opts.ports:
            log = log_dir / f"sglang_server_{port}.log"
            cmd = [python, "-m", opts.module, "--model-path", str(model_dir), "--host", opts.host,
                   "--port", str(port), *opts.args]
            with open(log, "wb") as out:
                self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                   start_new_session=True))
            self.logs.append(log)

    def wait_healthy(self, servers: list[SGLangServer], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for proc, log, server in zip(self.procs, self.logs, servers, strict=True):
            while True:
                if proc.poll() is not None:
                    tail = log.read_text(errors="replace")[-2000:] if log.is_file() else ""
                    self.stop()
                    raise UniRLError(f"SGLang server for {server.url} exited with status {proc.returncode} before "
                                     f"it was healthy; the end of {log}:\n{tail}")
                try:
                    server.healthy(min(2.0, max(0.1, deadline - time.monotonic())))
                    break
                except SGLangUnavailableError:
                    if time.monotonic() >= deadline:
                        self.stop()
                        raise UniRLError(f"SGLang server for {server.url} not healthy after {timeout_s:.0f}s "
                                         f"(rollout.options.launch.startup_timeout_s); see {log}") from None

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.procs = []
