"""SIGTERM to a real ``unirl train`` process on the FSDP actor (2 ranks on Ray, DCP checkpoints): the
run finishes its step, checkpoints, exits 143, leaves no Ray worker behind, and the resumed run ends with
the same weights as an uninterrupted one, byte for byte (issue 40)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "arith-tiny-fsdp.yaml"
ARGS = [
    "sft.steps=0", "trainer.steps=4", "trainer.prompts_per_step=4", "trainer.eval_every=0", "trainer.progress=false",
    "trainer.plot=false", "trainer.save_every=10", "data.arith.n_train=64", "data.arith.n_eval=4",
    "trainer.eval_k=2", "rollout.n=4", "rollout.max_new_tokens=4", "model.build={hidden_size: 64, intermediate_size: 128}",
    "actor.micro_batch_size=4", "actor.options={world_size: 2, cpus_per_rank: 0.5, threads_per_rank: 1}",
]
UNIRL = [sys.executable, "-m", "unirl.cli"]


def ray_workers() -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return {int(line.split()[0]) for line in out.splitlines() if "ray::" in line or "raylet" in line}


def run(out: Path, *extra: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([*UNIRL, "train", str(RECIPE), *ARGS, f"run.output_dir={out}", "run.name=r", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_sigterm_checkpoints_exits_143_without_orphans_and_resumes_to_the_same_weights(tmp_path):
    straight = run(tmp_path / "straight")
    assert straight.wait(timeout=900) == 0, straight.stderr.read()[-3000:]
    before = ray_workers()

    proc = run(tmp_path / "cut")
    metrics = tmp_path / "cut" / "r" / "metrics.jsonl"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:  # after the first RL step is logged
        if metrics.is_file() and any(json.loads(x)["step"] >= 1 for x in metrics.read_text().splitlines()):
            break
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)
    code = proc.wait(timeout=600)
    err = proc.stderr.read()
    assert code == 143, err[-3000:]
    assert "preempted at step" in err and "by SIGTERM" in err, err[-3000:]
    step = int(err.split("preempted at step ")[1].split()[0])
    assert 1 <= step < 4 and (tmp_path / "cut" / "r" / "checkpoints" / f"step_{step:06d}").is_dir()
    time.sleep(5)
    assert not ray_workers() - before, "a Ray worker outlived its preempted driver"

    resumed = run(tmp_path / "cut", "run.resume=true")
    assert resumed.wait(timeout=900) == 0, resumed.stderr.read()[-3000:]
    same = (tmp_path / "straight" / "r" / "hf" / "model.safetensors").read_bytes()
    assert (tmp_path / "cut" / "r" / "hf" / "model.safetensors").read_bytes() == same
