"""Ray actors die with the driver: on Ctrl-C mid-call and on a plain exit without ``close()``.

Each case runs a real driver in a subprocess that lets the plugin start its own Ray on loopback
(the path a user's ``unirl train`` takes), so this module shares no Ray session with the others.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.ray

DRIVER = r"""
import json, signal, sys
# Ctrl-C as at a terminal: a test run launched in the background of a non-interactive shell (`cmd &`)
# starts with SIGINT ignored, Python then installs no KeyboardInterrupt handler, and the driver would
# never see the signal this test sends (measured: the test hung to its 90 s timeout under `(nohup ... &)`)
signal.signal(signal.SIGINT, signal.default_int_handler)
from unirl.config import RunConfig
from unirl.models.qwen3 import Qwen3Adapter
from unirl.samples import Sample
from unirl.kernel import load_kernel
from unirl.runtime import build_runtime
from unirl.api import build_actor

cfg = RunConfig.model_validate({
    "model": {"build": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
                        "num_key_value_heads": 1}},
    "actor": {"name": "fsdp", "options": {"world_size": 2, "cpus_per_rank": 0.5}}})
actor = build_actor(cfg, adapter=Qwen3Adapter(), runtime=build_runtime(cfg, load_kernel(), worker_env={}))
print(json.dumps([i["pid"] for i in actor.group.info]), flush=True)
if sys.argv[1] == "exit":
    sys.exit(0)  # no close(): atexit and Ray's owner-death must clean up
samples = [Sample(id=f"p/{i}", prompt_ids=[5, 6, 7], response_ids=[8] * 200) for i in range(16)]
while True:
    actor.logprobs(samples)  # Ctrl-C lands in here, inside a collective call
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("how", ["sigint", "exit"])
def test_workers_are_reaped(how, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, how], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:]
        pids = json.loads(line)
        assert all(_alive(p) for p in pids)
        if how == "sigint":
            time.sleep(2.0)  # let it get into a logprobs call
            proc.send_signal(signal.SIGINT)
        # communicate, not wait: it drains the pipes, so a child whose stderr (Ray's shutdown logs, the
        # traceback) outgrows the pipe buffer cannot block on a write and look like a hang
        _, err = proc.communicate(timeout=90)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(_alive(p) for p in pids), f"rank processes {pids} outlived the driver"
        if how == "sigint":
            assert "KeyboardInterrupt" in err, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
