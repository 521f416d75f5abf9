"""A real full disk at a checkpoint (issue 66, build item 4): the run's output directory is a small tmpfs
this test mounts (it runs as root, as CI does), shrunk to just above what it holds once the first
checkpoint is written, so the second checkpoint's ``torch.save`` / safetensors write hits ENOSPC on
the real save path (no injected error). ``torch.save`` reports that as a ``RuntimeError`` with no
errno, which the run used to let through as a traceback.

- ``run.on_save_error: fail``: exit 2 with one ``error:`` line naming the checkpoint, ENOSPC and the fix;
  step 1's checkpoint and ``latest`` stay whole; with room again, ``run.resume=true`` finishes the run.
- ``run.on_save_error: warn``: a warning on stderr, training goes on to the last step.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from unirl import cli
from unirl.actor.checkpoint import checkpoint_problem, latest_checkpoint
from unirl.config import load_config
from unirl.kernel import load_kernel
from unirl.kernel.hookspecs import hookimpl

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "arith-tiny.yaml")
TINY = [
    "sft.steps=0", "trainer.steps=3", "trainer.save_every=1", "trainer.prompts_per_step=2", "trainer.eval_every=0",
    "trainer.eval_k=1", "trainer.progress=false", "trainer.plot=false", "trainer.export_hf=false",
    "data.arith.n_train=16", "data.arith.n_eval=2", "rollout.n=2", "rollout.max_new_tokens=2",
    "model.build={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1}",
]


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


@pytest.fixture
def disk(tmp_path):
    """A 16 MiB tmpfs at ``tmp_path/disk``, unmounted afterwards."""
    where = tmp_path / "disk"
    where.mkdir()
    mount("-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where))
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


class FillAfterFirstCheckpoint:
    """At step 2's rollout (step 1's checkpoint is on disk) the tmpfs shrinks to what it holds plus
    ``headroom`` (64 KiB: enough for metrics rows, not for a second checkpoint); with none, a filler file
    takes every last block, so every later write of the run (metrics, curves, memory.json) fails too."""

    def __init__(self, disk: Path, headroom: int = 64 * 1024) -> None:
        self.disk, self.headroom, self.done = disk, headroom, False

    @hookimpl
    def unirl_on_rollout(self, phase, step, version, samples, config):
        if phase == "train" and step == 1 and not self.done:
            self.done = True
            st = os.statvfs(self.disk)
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
            mount("-o", f"remount,size={used + self.headroom}", str(self.disk))
            if not self.headroom:
                try:
                    with open(self.disk / "filler", "wb") as f:
                        while True:
                            f.write(b"\0" * 4096)
                            f.flush()
                except OSError:
                    pass


def run(disk: Path, monkeypatch, capsys, *extra: str, fill: bool = True, headroom: int = 64 * 1024) -> tuple[int, str]:
    kernel = load_kernel(extra=[("fill", FillAfterFirstCheckpoint(disk, headroom))] if fill else ())
    monkeypatch.setattr(cli, "_load", lambda args: (load_config(args.recipe, args.overrides), kernel))
    code = cli.main(["train", RECIPE, *TINY, f"run.output_dir={disk}", "run.name=r", *extra])
    return code, capsys.readouterr().err


def test_a_full_disk_at_a_checkpoint_is_one_line_keeps_the_last_and_resumes(disk, monkeypatch, capsys):
    code, err = run(disk, monkeypatch, capsys)
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: checkpoint ") and "step_000002" in err and "ENOSPC" in err, err
    assert "step_000001 is intact" in err and "run.resume=true" in err and "run.on_save_error=warn" in err, err
    root = disk / "r" / "checkpoints"
    assert latest_checkpoint(root) == root / "step_000001"
    assert checkpoint_problem(root / "step_000001") is None  # whole: every file and its size
    assert not list(root.glob("step_000002*")), "the staged copy is removed"
    mount("-o", "remount,size=16m", str(disk))  # the user frees space, then resumes
    code, err = run(disk, monkeypatch, capsys, "run.resume=true", fill=False)
    assert code == 0, err
    assert latest_checkpoint(root) == root / "step_000003"


@pytest.mark.parametrize("headroom", [64 * 1024, 0])
def test_on_save_error_warn_trains_on_through_a_full_disk(disk, monkeypatch, capsys, headroom):
    code, err = run(disk, monkeypatch, capsys, "run.on_save_error=warn", *(["trainer.plot=true"] if not headroom else []),
                    headroom=headroom)
    assert code == 0, err
    assert "Traceback" not in err and "warning: checkpoint" in err and "ENOSPC" in err and "training on" in err, err
    if not headroom:  # the end of the run's own files (curves, memory.json): warnings too, not a traceback
        assert "warning: curves" in err and "checkpoints/step_000003" in err, err  # step 3 trained, its save warned
    root = disk / "r" / "checkpoints"
    assert latest_checkpoint(root) == root / "step_000001"
    assert checkpoint_problem(root / "step_000001") is None
    if headroom:
        rows = (disk / "r" / "metrics.jsonl").read_text().splitlines()
        assert '"step": 3' in rows[-1], rows[-1]  # every step trained and logged


def test_torch_save_and_safetensors_on_a_full_disk_raise_enospc(tmp_path):
    """The two libraries' own exceptions (torch.save: ``RuntimeError`` with no errno) become ENOSPC."""
    import errno

    import torch
    from safetensors.torch import save_file

    from unirl.fsio import as_os_errors

    where = tmp_path / "small"
    where.mkdir()
    mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where))
    try:
        t = {"w": torch.zeros(100_000)}
        for name, write in (("a.pt", lambda p: torch.save(t, p)), ("b.safetensors", lambda p: save_file(t, p))):
            with pytest.raises(OSError) as err, as_os_errors(where / name):
                write(str(where / name))
            assert err.value.errno == errno.ENOSPC and str(where / name) in str(err.value), name
            (where / name).unlink(missing_ok=True)
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
