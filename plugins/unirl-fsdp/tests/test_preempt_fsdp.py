"""SIGTERM to a real ``unirl train`` process on the FSDP actor (2 ranks on Ray, DCP checkpoints) at each of
three controlled points: mid-rollout, mid-train and mid-save (issue 40). Each time the run finishes its
step, checkpoints, exits 143, leaves no Ray process behind, and the resumed run ends with the same
weights and the same ``metrics.jsonl`` as one uninterrupted run, byte for byte.

The points are the ones core's embedded test uses (``core/tests/test_preemption_faults.py``), reached in
the process that runs them: this module is an in-process plugin of the driver (run in a subprocess, so
the pytest process never starts Ray) and is shipped to the ranks by module name, so

* mid-rollout: ``unirl_on_rollout`` of step 2's training rollout, in the driver;
* mid-train: ``unirl_before_backward`` of step 2's first micro-batch, in rank 0 (it signals the driver);
* mid-save: the checkpoint phase ``save:step_000002:rank0`` (rank 0's shards of step 2's scheduled save
  written, the checkpoint not committed), in rank 0.

``UNIRL_TEST_SIGTERM_AT`` (the point) and ``UNIRL_TEST_SIGTERM_PID`` (the driver) reach the ranks through
this module's ``unirl_worker_env``; unset, the plugin does nothing (the uninterrupted and resumed runs).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from unirl.actor import checkpoint as ckpt
from unirl.api import hookimpl
from unirl.testing import run_watched

if os.environ.get("CI") != "true":  # in CI a missing Ray fails the test
    pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
RECIPE = ROOT / "recipes" / "arith-tiny-fsdp.yaml"
ARGS = [
    "sft.steps=0", "trainer.steps=3", "trainer.prompts_per_step=4", "trainer.eval_every=0", "trainer.progress=false",
    "trainer.plot=false", "trainer.save_every=2", "data.arith.n_train=64", "data.arith.n_eval=4",
    "trainer.eval_k=2", "rollout.n=4", "rollout.max_new_tokens=4", "model.build={hidden_size: 64, intermediate_size: 128}",
    "reward.name=preempt_distinct", "algorithm.updates_per_batch=2",
    "actor.micro_batch_size=4", "actor.options={world_size: 2, cpus_per_rank: 0.5, threads_per_rank: 1}",
]
AT_ENV, PID_ENV, MARK_ENV = "UNIRL_TEST_SIGTERM_AT", "UNIRL_TEST_SIGTERM_PID", "UNIRL_TEST_SIGTERM_MARK"
#: ``unirl train`` (core's CLI: its exit codes and messages) with this module as an in-process plugin
DRIVER = """
import sys
sys.path.insert(0, sys.argv[1])
import test_preempt_fsdp as plugin
from unirl import cli
from unirl.kernel import load_kernel
load = cli._load
cli._load = lambda args: (load(args)[0], load_kernel(extra=[("preempt_fsdp", plugin)]))
sys.exit(cli.main(sys.argv[2:]))
"""
_sent: list[str] = []  # per process: each point signals once


def _sigterm_driver(point: str) -> None:
    if os.environ.get(AT_ENV) == point and not _sent:
        _sent.append(point)
        Path(os.environ[MARK_ENV]).write_text(f"{point} {os.getpid()}")  # who sent it, and where
        os.kill(int(os.environ.get(PID_ENV) or os.getpid()), signal.SIGTERM)


@hookimpl
def unirl_worker_env(config: Any) -> dict[str, str]:
    """The point and the driver's pid reach the ranks (the same keys in every run; empty is off)."""
    return {AT_ENV: os.environ.get(AT_ENV, ""), PID_ENV: str(os.getpid()), MARK_ENV: os.environ.get(MARK_ENV, "")}


@hookimpl
def unirl_rewards() -> dict[str, Any]:
    """A reward that differs within every group of an untrained policy, so every step moves the weights
    (``exact_int`` scores 0 for it: a resume that diverged would still end with the same weights)."""
    return {"preempt_distinct": lambda completion, sample: len(set(completion)) / 8.0}


@hookimpl
def unirl_on_rollout(phase: str, step: int) -> None:
    if phase == "train" and step == 1:
        _sigterm_driver("rollout")


@hookimpl
def unirl_before_backward(ctx: Any) -> None:
    if ctx.rank == 0 and ctx.rl_step == 1 and ctx.update == 0 and ctx.micro_batch == 0:
        _sigterm_driver("train")


def _phase(label: str) -> None:
    if label == "save:step_000002:rank0":
        _sigterm_driver("save")


if os.environ.get(AT_ENV) == "save":  # the driver and the ranks of a mid-save run only (never pytest's process)
    ckpt.set_phase_callback(_phase)


def run(out: Path, *extra: str, point: str | None = None) -> tuple[int, str, int]:
    """``unirl train`` (the driver) in a subprocess, SIGTERMed at ``point``; its exit code, output, pid."""
    env = {k: v for k, v in os.environ.items() if k not in (AT_ENV, PID_ENV, MARK_ENV, "RAY_ADDRESS")}
    if point:
        env |= {AT_ENV: point, MARK_ENV: str(out / "sigterm")}
    n = len(list(out.glob("life-*.log")))
    return run_watched([sys.executable, "-c", DRIVER, str(HERE), "train", str(RECIPE), *ARGS, f"run.output_dir={out}",
                        "run.name=r", *extra], env, out, out / f"life-{n}.log")


def untimed(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if not (k.endswith("_s") or k.startswith("mem/"))} for r in rows]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The one uninterrupted run every preempted-and-resumed one must end equal to."""
    out = tmp_path_factory.mktemp("straight")
    code, err, _ = run(out)
    assert code == 0, err[-3000:]
    return out / "r"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("point", ["rollout", "train", "save"])
def test_sigterm_mid_point_exits_143_with_a_checkpoint_and_resumes_byte_identical(tmp_path, straight, point):
    code, err, driver = run(tmp_path, point=point)
    assert code == 143, err[-3000:]
    sender, pid = (tmp_path / "sigterm").read_text().split()
    assert sender == point and (int(pid) != driver) == (point != "rollout")  # train, save: rank 0
    assert "preempted at step 2 by SIGTERM" in err and "step_000002" in err and "run.resume=true" in err, err[-3000:]
    run_dir = tmp_path / "r"
    root = run_dir / "checkpoints"
    assert ckpt.latest_checkpoint(root) == root / "step_000002" and ckpt.checkpoint_problem(root / "step_000002") is None
    assert not (root / "step_000003").exists() and not (run_dir / "hf").exists()
    assert [r["step"] for r in untimed(run_dir)] == [0, 1, 2]  # flushed through the step that finished
    saved = (root / "step_000002" / "meta.json").stat().st_mtime_ns

    code, err, _ = run(tmp_path, "run.resume=true")
    assert code == 0, err[-3000:]
    assert (root / "step_000002" / "meta.json").stat().st_mtime_ns == saved  # resumed there, not started over
    files = sorted(p.name for p in (straight / "hf").glob("model*.safetensors*"))  # export's files + index
    assert files and files == sorted(p.name for p in (run_dir / "hf").glob("model*.safetensors*"))
    for name in files:
        assert (run_dir / "hf" / name).read_bytes() == (straight / "hf" / name).read_bytes(), name
    assert untimed(run_dir) == untimed(straight)
    assert all(r["grad_norm"] > 0 for r in untimed(straight) if r["step"] > 0)  # every step moved the weights
