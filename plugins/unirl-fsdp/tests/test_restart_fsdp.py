"""``run.max_restarts`` on the FSDP actor (2 ranks on Ray): a rank process SIGKILLed five times in one
run, at seeded random points; each time the trainer tears the Ray placement down, rebuilds it and
resumes from the last checkpoint, and the final weights equal an uninterrupted run's, byte for byte
(sync FSDP resume is bit-exact), with no step logged twice (issue 40)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from unirl.api import hookimpl, load_config, load_kernel

pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "arith-tiny-fsdp.yaml"
ARGS = [
    "sft.steps=0", "trainer.steps=5", "trainer.prompts_per_step=4", "trainer.eval_every=0", "trainer.progress=false",
    "trainer.plot=false", "trainer.save_every=1", "trainer.keep_last=0", "data.arith.n_train=64",
    "data.arith.n_eval=4", "trainer.eval_k=2", "rollout.n=4", "rollout.max_new_tokens=4",
    "model.build={hidden_size: 64, intermediate_size: 128}", "actor.micro_batch_size=4",
    "actor.options={world_size: 2, cpus_per_rank: 0.5, threads_per_rank: 1}",
]


def rank_pids() -> list[int]:
    """Live FSDP rank processes (a killed rank's zombie, not yet reaped by its raylet, is not one)."""
    out = subprocess.run(["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines()]
    return sorted(int(r[0]) for r in rows if len(r) == 3 and "ray::FSDPWorker" in r[2] and not r[1].startswith("Z"))


class KillRanks:
    """SIGKILLs one live rank (seeded choice) at the end of each step in ``steps``, once per step."""

    def __init__(self, steps: set[int], seed: int = 0):
        self.left, self.rng, self.killed = set(steps), random.Random(seed), 0

    def step_end(self, step: int) -> None:
        pids = rank_pids()
        if step in self.left and pids:
            self.left.discard(step)
            os.kill(self.rng.choice(pids), signal.SIGKILL)
            self.killed += 1


#: this module is the in-process plugin (ranks import it by name too; only the driver ends steps)
KILLER = KillRanks(set())


@hookimpl
def unirl_on_step_end(step, metrics, config):
    KILLER.step_end(step)


def rows(run_dir: Path) -> list[dict]:
    skip = {"rollout_s", "replay_s", "train_s", "sync_s"}
    return [{k: v for k, v in json.loads(x).items()  # measurements: timings, per-phase memory (mem/)
             if not (k in skip or k.endswith("_s") or k.startswith("mem/"))}
            for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_five_rank_kills_restart_from_checkpoints_and_end_bitwise_as_an_uninterrupted_run(tmp_path):
    from unirl.api import train

    straight = load_config(RECIPE, [*ARGS, f"run.output_dir={tmp_path}", "run.name=straight"])
    train(straight, load_kernel())
    cut = load_config(RECIPE, [*ARGS, f"run.output_dir={tmp_path}", "run.name=cut", "run.max_restarts=5"])
    import test_restart_fsdp as this  # conftest puts this directory on sys.path (the ranks import it too)

    killer = this.KILLER = KillRanks({0, 1, 2, 3, 4}, seed=7)
    result = train(cut, load_kernel(extra=[("restart_fsdp", this)]))
    assert killer.killed == 5 and result.restarts == 5 and result.steps_done == 5
    assert len((cut.run_dir / "restarts.log").read_text().splitlines()) == 5
    assert rows(cut.run_dir) == rows(straight.run_dir)
    files = sorted(p.name for p in (straight.run_dir / "hf").glob("model*.safetensors*"))  # export's files + index
    assert files and files == sorted(p.name for p in (cut.run_dir / "hf").glob("model*.safetensors*"))
    for name in files:
        assert (cut.run_dir / "hf" / name).read_bytes() == (straight.run_dir / "hf" / name).read_bytes(), name
    deadline = time.monotonic() + 30  # ray.kill of the last group's ranks is asynchronous
    while rank_pids() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not rank_pids(), "an FSDP rank outlived the run"
