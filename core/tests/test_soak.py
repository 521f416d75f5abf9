"""Soak: a run killed with SIGKILL at seeded random points (inside steps, saves and prunes), resumed each
time with run.resume=true, ends bit-identical to an uninterrupted run: weights, optimizer state,
metrics.jsonl row for row, and retention obeyed. UNIRL_TEST_SAVE_SLEEP_S widens the save / prune windows
so kills land there deterministically."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from unirl.actor import checkpoint as ckpt
from unirl.config import load_config
from unirl.kernel import load_kernel
from unirl.trainer.loop import train

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "arith-tiny.yaml"
STEPS, KEEP_LAST, KEEP_EVERY = 20, 2, 4
ARGS = [
    "sft.steps=0", f"trainer.steps={STEPS}", "trainer.prompts_per_step=4", "trainer.eval_every=0",
    "trainer.progress=false", "trainer.plot=false", "trainer.save_every=1", f"trainer.keep_last={KEEP_LAST}",
    f"trainer.keep_every={KEEP_EVERY}", "data.arith.n_train=64", "data.arith.n_eval=8", "rollout.n=4",
    "rollout.max_new_tokens=4", "model.build={hidden_size: 64, intermediate_size: 128}",
]
KILLS = 8
#: the kill plan: each life is killed once; "save" / "prune" wait for that window, "any" at a random time
PLAN = ["any", "save", "any", "prune", "save", "any", "save", "any"]


def latest(root: Path) -> str | None:
    p = root / "latest"
    try:
        return p.read_text().strip()
    except FileNotFoundError:
        return None


def where(root: Path) -> str:
    """Where the kill landed, from what it left behind."""
    if list(root.glob(".prune-*")):
        return "mid-prune"
    if list(root.glob("step_*.tmp-*")) or list(root.glob("step_*.old-*")):
        return "mid-save"
    return "mid-step"


def wait_for(cond, proc: subprocess.Popen, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.005)
    raise AssertionError("soak: the run made no progress in time (hung?)")


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same(a, b, path="optim") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.slow
def test_soak_sigkill_anywhere_then_resume(tmp_path):
    t_start = time.perf_counter()
    rng = random.Random(1234)
    straight = train(load_config(RECIPE, [*ARGS, f"run.output_dir={tmp_path}", "run.name=straight"]), load_kernel())
    assert straight.steps_done == STEPS

    run = tmp_path / "soak"
    root = run / "checkpoints"
    env = {k: v for k, v in os.environ.items() if k != ckpt.SAVE_SLEEP_ENV}
    slow_save = {**env, ckpt.SAVE_SLEEP_ENV: "0.15"}  # lives aimed at a save / prune widen that window
    cmd = [sys.executable, "-m", "unirl.cli", "train", str(RECIPE), *ARGS, f"run.output_dir={tmp_path}",
           "run.name=soak", "run.resume=true"]
    landed: dict[str, int] = {"mid-step": 0, "mid-save": 0, "mid-prune": 0}
    lives = 0
    for kill in range(KILLS + 1):
        lives += 1
        before = latest(root)
        mode = PLAN[kill] if kill < KILLS else "end"
        proc = subprocess.Popen(cmd, env=env if mode in ("any", "end") else slow_save, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            if kill == KILLS:  # the last life runs to the end
                _, err = proc.communicate(timeout=300)
                assert proc.returncode == 0, err.decode()[-3000:]
                break
            # every life commits at least one checkpoint before it is killed (the soak must progress)
            if not wait_for(lambda b=before: latest(root) not in (None, b), proc, 120):
                break
            if mode == "save":
                wait_for(lambda: bool(list(root.glob("step_*.tmp-*"))), proc, 60)
                time.sleep(rng.uniform(0.0, 0.4))
            elif mode == "prune":
                wait_for(lambda: bool(list(root.glob(".prune-*"))), proc, 60)
            else:
                time.sleep(rng.uniform(0.0, 0.8))
            if proc.poll() is not None:
                break
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            landed[where(root)] += 1
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stderr:
                proc.stderr.close()
    else:  # pragma: no cover
        pytest.fail("the final life did not run")
    kills = sum(landed.values())
    print(f"\nsoak: {kills} SIGKILLs over {lives} lives: {landed}; {time.perf_counter() - t_start:.0f}s")
    if proc.returncode != 0 or kills < KILLS:  # a life finished the run before its kill was due
        pytest.fail(f"only {kills} kills landed ({landed}); the run finished early: lengthen trainer.steps")
    assert landed["mid-save"] >= 2 and landed["mid-prune"] >= 1, landed

    final = f"step_{STEPS:06d}"
    a, b = tmp_path / "straight" / "checkpoints" / final, root / final
    wa, wb = load_file(a / ckpt.MODEL_FILE), load_file(b / ckpt.MODEL_FILE)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), "final weights"
    load = lambda p: torch.load(p / ckpt.OPTIM_FILE, map_location="cpu", weights_only=False)  # noqa: E731
    assert_same(load(a), load(b))
    assert untimed(rows(run)) == untimed(rows(tmp_path / "straight")), "metrics.jsonl row for row"
    assert [r["step"] for r in rows(run)] == list(range(STEPS + 1))

    want = ckpt.retained_steps(range(1, STEPS + 1), keep_last=KEEP_LAST, keep_every=KEEP_EVERY)
    assert sorted(p.name for p in root.iterdir()) == ["latest", *[f"step_{s:06d}" for s in sorted(want)]]
    assert latest(root) == final
