"""Soak of the FSDP actor (2 ranks on Ray, DCP checkpoints): the driver SIGKILLed mid-save, then one rank's
process SIGKILLed mid-step, each time resumed with run.resume=auto; nothing hangs, the dead rank is named,
no rank outlives its driver, and the final weights and optimizer state equal an uninterrupted run's.

Kills are placed by core's checkpoint drill (``core/tests/checkpoint_drill.py``), installed as the
checkpoint phase callback whenever this module is imported (the driver, and each rank, which imports it
for :class:`SoakWorker`): the life's ``UNIRL_TEST_HOLD_AT`` reaches the ranks through this module's ``unirl_worker_env`` (it is an in-process
plugin of every run, shipped to the ranks by module name); :class:`SoakWorker` adds the mid-step phase
``train:step_N:update<u>:rank<r>``, the worker's save has ``save:step_N:rank<r>`` (after the rank's shards)
and ``commit:step_N``. The held process writes the hold file and blocks until it is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from unirl.actor import checkpoint as ckpt
from unirl.api import hookimpl

pytest.importorskip("ray")
pytestmark = pytest.mark.ray

from fsdp_support import DrillWorker  # noqa: E402 - conftest puts this directory on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "core" / "tests"))
import checkpoint_drill as drill  # noqa: E402 - core's test drill, found through the line above

drill.install()  # in every process that imports this module: the driver and each rank

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
RECIPE = ROOT / "recipes" / "arith-tiny-fsdp.yaml"
STEPS, KEEP_LAST = 5, 2
ARGS = [
    "sft.steps=0", f"trainer.steps={STEPS}", "trainer.prompts_per_step=4", "trainer.eval_every=0",
    "trainer.progress=false", "trainer.plot=false", "trainer.save_every=1", f"trainer.keep_last={KEEP_LAST}",
    "trainer.keep_every=0", "data.arith.n_train=64", "data.arith.n_eval=8", "rollout.n=4",
    "rollout.max_new_tokens=4", "model.build={hidden_size: 64, intermediate_size: 128}",
    "reward.name=soak_distinct", "algorithm.updates_per_batch=2", "actor.micro_batch_size=4",
    "actor.options={world_size: 2, cpus_per_rank: 0.5, threads_per_rank: 1, step_timeout_s: 300, "
    "worker_cls: 'test_soak_fsdp:SoakWorker'}",
]
HOOK_ENVS = (drill.HOLD_AT_ENV, drill.HOLD_FILE_ENV)
#: one life: the real trainer, with this module as an in-process plugin (shipped to the ranks by name)
DRIVER = """
import sys
sys.path.insert(0, sys.argv[1])
import test_soak_fsdp
from unirl.api import load_config, load_kernel, train
train(load_config(sys.argv[2], sys.argv[3:]), load_kernel(extra=[("soak_fsdp", test_soak_fsdp)]))
"""


@hookimpl
def unirl_worker_env(config: Any) -> dict[str, str]:
    """The drill hook's variables reach the ranks (Ray runtime_env); the same keys in every life (empty
    is off), so every life's ranks start the same way."""
    return {k: os.environ.get(k, "") for k in HOOK_ENVS}


def distinct_chars(completion: str, sample: Any) -> float:
    """A reward that varies within every group of a random policy: non-zero advantages and gradients in
    every step (``exact_int`` scores 0 for this untrained model, so the weights would never move)."""
    return len(set(completion)) / 8.0


@hookimpl
def unirl_rewards() -> dict[str, Any]:
    return {"soak_distinct": distinct_chars}


class SoakWorker(DrillWorker):
    """A rank with the mid-step drill phase: before each update's micro-batches."""

    def train_step(self, *args: Any) -> dict[str, Any]:
        info = args[-1]
        ckpt.checkpoint_phase(f"train:step_{info.rl_step + 1:06d}:update{info.update}:rank{self.rank}")
        return super().train_step(*args)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def rank_pids(driver_pid: int) -> list[int]:
    """The processes holding ``ray::SoakWorker`` that descend from ``driver_pid`` (Ray's raylet starts
    them as its children, the driver starts the raylet)."""
    kids: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            names[int(d.name)] = (d / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d.name))
    out, todo = [], [driver_pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            todo.append(c)
            if "SoakWorker" in names.get(c, ""):
                out.append(c)
    return out


def life(tmp_path: Path, n: int, hold_at: str | None) -> tuple[subprocess.Popen, Path, Path]:
    env = {k: v for k, v in os.environ.items() if k not in (*HOOK_ENVS, "RAY_ADDRESS")}
    hold = tmp_path / f"hold-{n}"
    if hold_at:
        env |= {drill.HOLD_AT_ENV: hold_at, drill.HOLD_FILE_ENV: str(hold)}
    log = tmp_path / f"life-{n}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(HERE), str(RECIPE), *ARGS,
                                 f"run.output_dir={tmp_path}", "run.name=soak", "run.resume=auto"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    return proc, hold, log


def wait_hold(proc: subprocess.Popen, hold: Path, log: Path, pattern: str) -> int:
    deadline = time.monotonic() + 900  # a hang guard: generous for a loaded machine
    while not hold.exists():
        assert proc.poll() is None, f"the life ended before {pattern}: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"the life never reached {pattern} (hung?)"
        time.sleep(0.02)
    label, pid = hold.read_text().split()
    assert label == pattern
    return int(pid)


def final_state(run: Path) -> dict[str, Any]:
    """The final checkpoint's DCP state (model + optimizer), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = run / "checkpoints" / f"step_{STEPS:06d}" / "dcp"
    out = run.parent / f"{run.name}-final.pt"
    dcp_to_torch_save(str(src), str(out))
    return torch.load(out, map_location="cpu", weights_only=False)


def flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in flat(val, f"{prefix}{key}.").items()}
    if isinstance(obj, list | tuple):
        return {k: v for i, val in enumerate(obj) for k, v in flat(val, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): obj}


def untimed(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if not (k.endswith("_s") or k.startswith("mem/"))} for r in rows]


@pytest.mark.slow
@pytest.mark.timeout(2400)  # ~2 min idle; a 2-core machine shared with other jobs can be 10x slower
def test_fsdp_soak_kill_driver_then_rank_then_resume(tmp_path):
    t0 = time.perf_counter()
    straight_dir = tmp_path / "straight"
    straight_dir.mkdir()
    straight, _, straight_log = life(straight_dir, 0, None)  # the uninterrupted run (alone: two Rays
    assert straight.wait(timeout=900) == 0, straight_log.read_text()[-3000:]  # starting at once can time out)
    root = tmp_path / "soak" / "checkpoints"
    landed: list[str] = []

    # 1. the driver, SIGKILLed while rank 0 is inside the save of step 2 (its shards written, not committed)
    proc, hold, log = life(tmp_path, 1, "save:step_000002:rank0")
    try:
        wait_hold(proc, hold, log, "save:step_000002:rank0")
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 2, ranks
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 60  # Ray's processes share the driver's fate: no rank is left behind
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in ranks), f"rank processes {ranks} outlived the SIGKILLed driver"
    assert list(root.glob("step_000002.tmp-*")) and (root / "latest").read_text().strip() == "step_000001"
    landed.append("driver mid-save")

    # 2. rank 1's process, SIGKILLed mid-step 4: the driver must stop (not hang) and name rank 1
    proc, hold, log = life(tmp_path, 2, "train:step_000004:update1:rank1")
    try:
        pid = wait_hold(proc, hold, log, "train:step_000004:update1:rank1")
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        rc = proc.wait(timeout=120)
        t_fail = time.monotonic() - t_kill
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    # a rank whose process died is a lost worker (run.max_restarts may restart it): RankLostError
    assert rc != 0 and "RankLostError: fsdp rank 1 failed during train_step" in text, text[-3000:]
    assert (root / "latest").read_text().strip() == "step_000003"
    landed.append("rank 1 mid-step")

    # 3. resumed to the end
    proc, _, log = life(tmp_path, 3, None)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert all(r["grad_norm"] > 0 for r in untimed(straight_dir / "soak") if r["step"] > 0)  # weights move
    print(f"\nfsdp soak: kills {landed}; rank death reported in {t_fail:.1f}s after the kill; "
          f"all {time.perf_counter() - t0:.0f}s")

    a, b = flat(final_state(straight_dir / "soak")), flat(final_state(tmp_path / "soak"))
    assert a.keys() == b.keys()
    assert any(k.startswith("optim.state.") for k in a), sorted(a)[:10]
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k
    assert untimed(tmp_path / "soak") == untimed(straight_dir / "soak"), "metrics.jsonl row for row"
    kept = sorted(p.name for p in root.iterdir())
    assert kept == ["latest", *[f"step_{s:06d}" for s in range(STEPS - KEEP_LAST + 1, STEPS + 1)]], kept
