"""Preemption and faults on the embedded recipe (issue 40, parts 1-3): SIGTERM / SIGINT finish the
step, checkpoint and exit 143 / 130, and the resume ends bit-identical to an uninterrupted run; a second
signal stops at once; the grace bounds the wait; a failed save keeps the previous checkpoint; a
non-finite update is dropped (skip) or stops the run with a debug bundle (abort).

The signals are real (``os.kill`` of this process, delivered to the handler the trainer installs);
the faults are injected on the real code paths (the checkpoint writer, the loss's advantages)."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import time
from pathlib import Path

import pytest

from unirl import cli
from unirl.actor import checkpoint as ckpt_module
from unirl.config import load_config
from unirl.kernel import load_kernel
from unirl.kernel.hookspecs import hookimpl
from unirl.trainer.failures import NonFiniteError
from unirl.trainer.loop import train
from unirl.trainer.preempt import Preempted
from unirl.trainer.write_errors import RunWriteError

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "arith-tiny.yaml"
SMALL = [
    "sft.steps=10", "sft.batch_size=16", "trainer.steps=4", "trainer.prompts_per_step=4", "trainer.eval_every=0",
    "trainer.progress=false", "trainer.plot=false", "trainer.export_hf=false", "data.arith.n_train=64",
    "data.arith.n_eval=4", "rollout.n=4", "rollout.max_new_tokens=4", "trainer.eval_k=2",
]
TIMINGS = {"rollout_s", "replay_s", "train_s", "sync_s", "publish_lag_s"}


def config(tmp_path, name, *extra):
    return load_config(RECIPE, [*SMALL, f"run.output_dir={tmp_path}", f"run.name={name}", *extra])


def final_weights(run_dir: Path) -> bytes:
    return (run_dir / "checkpoints" / "step_000004" / "model.safetensors").read_bytes()


def rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items()  # measurements: timings, per-phase memory (mem/)
             if not (k in TIMINGS or k.endswith("_s") or k.startswith("mem/"))}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted run every interrupted one must end equal to."""
    out = tmp_path_factory.mktemp("straight")
    train(config(out, "r", "trainer.save_every=1"), load_kernel())
    return out / "r"


class Signal:
    """Sends ``signum`` to this process at one point of step ``at`` (0-based)."""

    def __init__(self, point: str, at: int = 1, signum: int = signal.SIGTERM, again: str | None = None):
        self.point, self.at, self.signum, self.again = point, at, signum, again
        self.sent = 0

    def fire(self, point: str, step: int) -> None:
        if step == self.at and (point == self.point or point == self.again) and self.sent < 1 + bool(self.again):
            self.sent += 1
            os.kill(os.getpid(), self.signum)

    @hookimpl
    def unirl_on_rollout(self, phase, step, version, samples, config):
        if phase == "train":
            self.fire("rollout", step)

    @hookimpl
    def unirl_before_backward(self, ctx, config):
        if ctx.micro_batch == 0:
            self.fire("train", ctx.rl_step)


@pytest.mark.parametrize("point", ["rollout", "train", "save"])
def test_sigterm_finishes_the_step_checkpoints_exits_143_and_resumes_bit_identical(tmp_path, straight, point,
                                                                                   monkeypatch):
    sig = Signal(point, at=1)
    if point == "save":  # during step 2's own scheduled save (save_every=2), between two of its files
        def phase(label: str) -> None:
            if label == "save:step_000002:model.safetensors" and not sig.sent:
                sig.sent = 1
                os.kill(os.getpid(), signal.SIGTERM)

        monkeypatch.setattr(ckpt_module, "_phase_callback", phase)
    cfg = config(tmp_path, "r", "trainer.save_every=2")
    with pytest.raises(Preempted) as err:
        train(cfg, load_kernel(extra=[("signal", sig)]))
    assert err.value.exit_code == 143 and sig.sent
    assert "preempted at step 2 by SIGTERM" in str(err.value) and "step_000002" in str(err.value)
    assert (cfg.run_dir / "checkpoints" / "step_000002").is_dir()
    assert not (cfg.run_dir / "checkpoints" / "step_000003").exists()
    assert [r["step"] for r in rows(cfg.run_dir)] == [0, 1, 2]  # flushed through the step that finished
    monkeypatch.undo()
    train(config(tmp_path, "r", "trainer.save_every=2", "run.resume=true"), load_kernel())
    assert final_weights(cfg.run_dir) == final_weights(straight)
    assert rows(cfg.run_dir) == rows(straight)


def test_sigint_exits_130_through_the_cli_with_the_resume_command(tmp_path, capsys):
    """Ctrl-C (SIGINT) through ``unirl train``: exit 130 and the line saying where the checkpoint is."""
    kernel = load_kernel(extra=[("signal", Signal("train", at=0, signum=signal.SIGINT))])
    original = cli._load if hasattr(cli, "_load") else None

    def load(args):
        c, _ = original(args)
        return c, kernel

    cli._load = load
    try:
        code = cli.main(["train", str(RECIPE), *SMALL, f"run.output_dir={tmp_path}", "run.name=r",
                         "trainer.save_every=0"])
    finally:
        cli._load = original
    err = capsys.readouterr().err
    assert code == 130, err
    assert "preempted at step 1 by SIGINT" in err and "run.resume=true" in err
    assert (tmp_path / "r" / "checkpoints" / "step_000001").is_dir()


def test_a_second_signal_stops_at_once_and_the_last_checkpoint_stays_whole(tmp_path):
    sig = Signal("rollout", at=2, again="train")
    cfg = config(tmp_path, "r", "trainer.save_every=1")
    with pytest.raises(Preempted) as err:
        train(cfg, load_kernel(extra=[("signal", sig)]))
    assert err.value.exit_code == 143 and "second SIGTERM" in str(err.value)
    assert sig.sent == 2
    root = cfg.run_dir / "checkpoints"
    assert ckpt_module.latest_checkpoint(root) == root / "step_000002"  # step 3 never finished
    assert ckpt_module.checkpoint_problem(root / "step_000002") is None
    result = train(config(tmp_path, "r", "trainer.save_every=1", "run.resume=true"), load_kernel())
    assert result.steps_done == 4


class Slow:
    """Makes step ``at``'s training outlast the grace (after the signal arrived)."""

    @hookimpl
    def unirl_before_backward(self, ctx, config):
        if ctx.rl_step == 1 and ctx.micro_batch == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # interrupted by the grace timer
                time.sleep(0.05)


def test_past_the_grace_the_run_exits_without_saving_and_says_so(tmp_path):
    cfg = config(tmp_path, "r", "trainer.save_every=1", "run.preempt_grace_s=0.5")
    t0 = time.monotonic()
    with pytest.raises(Preempted) as err:
        train(cfg, load_kernel(extra=[("slow", Slow())]))
    assert time.monotonic() - t0 < 25
    assert err.value.exit_code == 143 and "run.preempt_grace_s=0.5 passed" in str(err.value)
    assert "without a new checkpoint" in str(err.value)
    root = cfg.run_dir / "checkpoints"
    assert ckpt_module.latest_checkpoint(root) == root / "step_000001"


def test_sigterm_with_no_checkpoint_at_all_says_so_and_prints_no_failing_resume(tmp_path, capsys, monkeypatch):
    """Issue 66: the grace passes at step 2 with trainer.save_every=0, so no checkpoint exists at all. The
    message must not claim "the last whole one is intact", and the command it prints must not be a resume
    (``run.resume=true`` would fail: nothing to resume); the one it prints does start the run."""
    kernel = load_kernel(extra=[("slow", Slow())])
    monkeypatch.setattr(cli, "_load", lambda args: (load_config(args.recipe, args.overrides), kernel))
    argv = [str(RECIPE), *SMALL, f"run.output_dir={tmp_path}", "run.name=r", "trainer.save_every=0",
            "run.preempt_grace_s=0.5"]
    assert cli.main(["train", *argv]) == 143
    err = capsys.readouterr().err
    assert not (tmp_path / "r" / "checkpoints").is_dir() or not ckpt_module.checkpoint_steps(tmp_path / "r" / "checkpoints")
    assert "intact" not in err and "run.resume=true" not in err, err
    assert "no checkpoint yet" in err and "Start again with" in err, err
    command = err.strip().splitlines()[-1].split()
    assert command[:2] == ["unirl", "train"] and command[2:] == argv, command


# ------------------------------------------------------------------------------ full disk


def enospc_at(monkeypatch, step: int) -> None:
    """The checkpoint writer of ``step_<step>`` fails as a full disk does (on the real save path)."""
    real = ckpt_module._write_torch

    def write(obj, path):
        if f"step_{step:06d}" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(obj, path)

    monkeypatch.setattr(ckpt_module, "_write_torch", write)


def test_a_full_disk_during_save_names_the_path_and_fix_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    enospc_at(monkeypatch, 2)
    cfg = config(tmp_path, "r", "trainer.save_every=1")
    with pytest.raises(RunWriteError) as err:
        train(cfg, load_kernel())
    text = str(err.value)
    assert "checkpoint" in text and "step_000002" in text and "ENOSPC" in text and "MB" in text
    assert "step_000001 is intact" in text and "run.output_dir" in text and "run.on_save_error=warn" in text
    root = cfg.run_dir / "checkpoints"
    assert ckpt_module.latest_checkpoint(root) == root / "step_000001"
    assert not list(root.glob("step_000002*"))  # the staged copy is gone too
    monkeypatch.undo()
    assert train(config(tmp_path, "r", "trainer.save_every=1", "run.resume=true"), load_kernel()).steps_done == 4


def test_on_save_error_warn_trains_on_and_the_next_interval_saves(tmp_path, monkeypatch, capsys):
    enospc_at(monkeypatch, 2)
    cfg = config(tmp_path, "r", "trainer.save_every=1", "run.on_save_error=warn", "trainer.progress=true")
    assert train(cfg, load_kernel()).steps_done == 4
    assert "warning: checkpoint" in capsys.readouterr().err  # stderr, whatever trainer.progress says
    steps = sorted(p.name for p in (cfg.run_dir / "checkpoints").glob("step_*"))
    assert "step_000002" not in steps and "step_000003" in steps and "step_000004" in steps


# ------------------------------------------------------------------------------ NaN / Inf


class NaNAdvantages:
    """A loss modifier that poisons the advantages of every update of steps ``steps`` (0-based)."""

    def __init__(self, steps: set[int]):
        self.steps, self.calls = steps, 0

    @hookimpl
    def unirl_loss_modifiers(self):
        return {"nan": self.modify}

    def modify(self, samples, batch, config):
        step, self.calls = self.calls, self.calls + 1
        if step in self.steps:
            for a in batch["advantages"]:
                a.fill_(math.nan)
        return {}


def test_nonfinite_skip_drops_the_update_and_counts_it(tmp_path):
    cfg = config(tmp_path, "r", "trainer.save_every=1", "trainer.keep_last=0", "algorithm.modifiers=[nan]",
                 "algorithm.nonfinite=skip")
    result = train(cfg, load_kernel(extra=[("nan", NaNAdvantages({1}))]))
    assert result.steps_done == 4
    by_step = {h["step"]: h for h in result.history}
    # every one of the step's updates (the recipe's updates_per_batch: 4) was dropped
    assert by_step[2]["nonfinite_updates"] == 4 and "nonfinite_updates" not in by_step[1]
    assert math.isnan(by_step[2]["grad_norm"])
    root = cfg.run_dir / "checkpoints"
    # the dropped update left the weights and the optimizer state exactly as step 1 left them
    for name in ("model.safetensors", "optim.pt"):
        assert (root / "step_000002" / name).read_bytes() == (root / "step_000001" / name).read_bytes(), name
    assert (root / "step_000003" / "model.safetensors").read_bytes() != (root / "step_000002" / "model.safetensors").read_bytes()


def test_nonfinite_abort_names_the_step_the_tensor_and_the_samples_with_a_debug_bundle(tmp_path):
    cfg = config(tmp_path, "r", "trainer.save_every=1", "algorithm.modifiers=[nan]")
    with pytest.raises(NonFiniteError) as err:
        train(cfg, load_kernel(extra=[("nan", NaNAdvantages({1}))]))
    text = str(err.value)
    assert "stopped after step 2" in text and "non-finite" in text and "algorithm.nonfinite=skip" in text
    assert "@train-1/" in text  # the batch's sample ids
    bundle = cfg.run_dir / "debug" / "nonfinite-step_000002.pt"
    assert bundle.is_file()
    import torch

    saved = torch.load(bundle, weights_only=False)
    assert saved["step"] == 2 and saved["samples"] and all(s["seed"] is not None for s in saved["samples"])
    assert (cfg.run_dir / "checkpoints" / "step_000001").is_dir()


def test_nonfinite_patience_without_abort_is_reported_at_preflight(tmp_path):
    from unirl.preflight import preflight

    found = preflight(config(tmp_path, "r", "algorithm.nonfinite=skip", "algorithm.nonfinite_patience=3"),
                      load_kernel())
    assert [v.field for v in found] == ["algorithm.nonfinite_patience"]
    assert "algorithm.nonfinite: abort" in found[0].fix


# ------------------------------------------------------------------------------ restarts


class LoseWorker:
    """Raises a lost-worker error (as an FSDP rank's or an engine's death surfaces) once at the end of
    each step in ``steps``: after the step, before its checkpoint."""

    def __init__(self, steps: set[int]):
        self.left = set(steps)

    @hookimpl
    def unirl_on_step_end(self, step, metrics, config):
        if step in self.left:
            self.left.discard(step)
            from unirl.kernel.errors import WorkerLostError

            raise WorkerLostError(f"test: worker lost after step {step + 1}")


def test_max_restarts_resumes_from_the_last_checkpoint_and_ends_as_an_uninterrupted_run(tmp_path, straight):
    cfg = config(tmp_path, "r", "trainer.save_every=1", "run.max_restarts=3")
    result = train(cfg, load_kernel(extra=[("lose", LoseWorker({0, 1, 3}))]))
    assert result.steps_done == 4 and result.restarts == 3
    assert final_weights(cfg.run_dir) == final_weights(straight)
    assert rows(cfg.run_dir) == rows(straight)  # no step logged twice
    log = (cfg.run_dir / "restarts.log").read_text().splitlines()
    assert len(log) == 3 and "restart 1/3" in log[0] and "starting over" in log[0]
    assert "resuming from" in log[1] and "step_000001" in log[1]


def test_without_restarts_a_lost_worker_fails_the_run_by_name(tmp_path):
    from unirl.kernel.errors import WorkerLostError

    with pytest.raises(WorkerLostError, match="worker lost after step 2"):
        train(config(tmp_path, "r", "trainer.save_every=1"), load_kernel(extra=[("lose", LoseWorker({1}))]))
