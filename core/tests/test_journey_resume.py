"""Resume as a user meets it, through the CLI entry: Ctrl-C with the default ``save_every`` then the
printed command continues the run bit for bit; a truncated checkpoint is named, set aside and the
previous one is used (bit for bit again); ``run.resume=true`` with nothing to resume, or with only
corrupt checkpoints, is an exit-2 message before any model is built; ``run.resume=auto`` says what it chose.

The oracle of every "continues" is the uninterrupted run of the same config: its step-12 weights.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from unirl import cli
from unirl.actor.checkpoint import checkpoint_problem, resume_candidates
from unirl.config import load_config
from unirl.kernel import manager
from unirl.kernel.hookspecs import hookimpl
from unirl.trainer import loop
from unirl.trainer.run_dir import ResumeError, choose_checkpoint

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "arith-tiny.yaml")
# 12 steps: the default trainer.save_every (10) checkpoints at 10 and at the end
TINY = [
    "sft.steps=0", "trainer.steps=12", "trainer.prompts_per_step=2", "trainer.eval_every=0", "trainer.eval_k=1",
    "trainer.progress=false", "trainer.plot=false", "trainer.export_hf=false", "data.arith.n_train=16",
    "data.arith.n_eval=2", "rollout.n=2", "rollout.max_new_tokens=3",
    "model.build={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1}",
]


def args(out: Path, name: str, *extra: str) -> list[str]:
    return [f"run.output_dir={out}", f"run.name={name}", *TINY, *extra]


def model_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(ckpt / "model.safetensors")


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted run, default save_every: checkpoints step 10 and step 12."""
    out = tmp_path_factory.mktemp("journey")
    assert cli.main(["train", RECIPE, *args(out, "straight")]) == 0
    ckpts = out / "straight" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000010", "step_000012"]
    return out / "straight"


class CtrlC:
    """A real SIGINT to this process after step ``at`` is logged (before its checkpoint): the trainer
    finishes that step, checkpoints it and exits 130."""

    def __init__(self, at: int) -> None:
        self.at = at

    @hookimpl
    def unirl_on_step_end(self, step):
        if step + 1 == self.at:
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_then_the_printed_command_continues_bit_for_bit(straight, tmp_path, monkeypatch, capsys):
    real = manager.load_kernel

    def with_ctrl_c(**kw):
        kernel = real(**kw)
        kernel.register(CtrlC(11), entry_point="ctrl-c", dist="test-ctrl-c", version="0")
        return kernel

    monkeypatch.setattr(manager, "load_kernel", with_ctrl_c)
    try:
        code = cli.main(["train", RECIPE, *args(tmp_path, "r")])
    except KeyboardInterrupt:  # pragma: no cover - the CLI must catch it
        pytest.fail("the CLI let KeyboardInterrupt escape")
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    # the first Ctrl-C finishes step 11 and checkpoints it (docs/operations.md)
    assert "preempted at step 11 by SIGINT" in err and "step_000011" in err, err
    command = err.strip().splitlines()[-1].strip()
    assert command.endswith("run.resume=true") and command.startswith("unirl train ")
    monkeypatch.setattr(manager, "load_kernel", real)

    assert cli.main(shlex.split(command)[1:]) == 0  # exactly what the hint said
    assert_same(model_weights(straight / "checkpoints" / "step_000012"),
                model_weights(tmp_path / "r" / "checkpoints" / "step_000012"))


def test_truncated_checkpoint_is_named_skipped_and_the_previous_one_continues(straight, tmp_path, capsys):
    run = tmp_path / "r"
    shutil.copytree(straight, run)
    bad = run / "checkpoints" / "step_000012" / "model.safetensors"
    with open(bad, "r+b") as f:
        f.truncate(bad.stat().st_size // 2)
    plan = choose_checkpoint(load_config(RECIPE, args(tmp_path, "r", "run.resume=true")))
    notes = plan.notes
    assert plan.checkpoint == run / "checkpoints" / "step_000010"
    assert any("step_000012" in n and "model.safetensors" in n and "truncated" in n for n in notes), notes
    assert list((run / "checkpoints").glob("step_000012.corrupt-*")), "the corrupt one is set aside, not deleted"
    # and the run goes on from step 10 to the same step-12 weights as the straight run
    assert cli.main(["train", RECIPE, *args(tmp_path, "r", "run.resume=true")]) == 0
    assert_same(model_weights(straight / "checkpoints" / "step_000012"),
                model_weights(run / "checkpoints" / "step_000012"))


def test_checkpoint_problems_name_the_file(straight, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(straight / "checkpoints", root)
    assert checkpoint_problem(root / "step_000012") is None
    extra = root / "step_000012" / "extra.pt"
    extra.write_bytes(extra.read_bytes()[:100])
    assert "extra.pt" in checkpoint_problem(root / "step_000012")
    (root / "step_000010" / "optim.pt").unlink()
    assert checkpoint_problem(root / "step_000010") == "optim.pt is missing"
    (root / "step_000010" / "meta.json").write_text("{")
    assert "meta.json is unreadable" in checkpoint_problem(root / "step_000010")
    chosen, skipped = resume_candidates(root)
    assert chosen is None and [p.name for p, _ in skipped] == ["step_000012", "step_000010"]


def test_latest_naming_a_missing_step_falls_back(straight, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(straight / "checkpoints", root)
    (root / "latest").write_text("step_000099\n")
    chosen, skipped = resume_candidates(root)
    assert chosen == root / "step_000012"
    assert skipped == [(root / "step_000099", "'latest' names step_000099, which is not there")]


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was built although the resume request was hopeless")

    monkeypatch.setattr(loop, "build_components", refuse)


def test_resume_with_nothing_to_resume_is_an_error_before_any_model(tmp_path, no_model, capsys):
    assert cli.main(["train", RECIPE, *args(tmp_path, "r", "run.resume=true")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"nothing to resume in {tmp_path / 'r'}" in err and "run.resume=auto" in err, err
    assert not (tmp_path / "r").exists()


def test_only_corrupt_checkpoints_is_an_error_naming_each(straight, tmp_path, no_model, capsys):
    for resume in ("true", "auto"):  # auto must not bury them under a fresh run either
        run = tmp_path / f"r-{resume}"
        shutil.copytree(straight, run)
        for step in ("step_000010", "step_000012"):
            (run / "checkpoints" / step / "rng.pt").write_bytes(b"")
        assert cli.main(["train", RECIPE, *args(tmp_path, f"r-{resume}", f"run.resume={resume}")]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert "no whole checkpoint" in err and "step_000010: rng.pt" in err and "step_000012: rng.pt" in err, err
        assert (run / "checkpoints" / "step_000012").is_dir(), "nothing is moved when nothing can be used"


def test_resume_auto_says_what_it_chose(straight, tmp_path):
    fresh = choose_checkpoint(load_config(RECIPE, args(tmp_path, "new", "run.resume=auto")))
    assert fresh.checkpoint is None and "starting fresh" in fresh.notes[0]
    shutil.copytree(straight, tmp_path / "old")
    plan = choose_checkpoint(load_config(RECIPE, args(tmp_path, "old", "run.resume=auto")))
    assert plan.checkpoint == tmp_path / "old" / "checkpoints" / "step_000012"
    assert plan.notes == [f"resuming from {plan.checkpoint} (run.resume=auto)"]
    with pytest.raises(ResumeError, match="nothing to resume"):
        choose_checkpoint(load_config(RECIPE, args(tmp_path, "new", "run.resume=true")))


def test_a_save_killed_mid_swap_is_restored_then_chosen(straight, tmp_path):
    """A kill between moving step_12 aside (re-save) and renaming its successor in leaves only
    step_12.old-<pid>: cleanup puts it back first, then it is the checkpoint resumed (not a stale path)."""
    shutil.copytree(straight, tmp_path / "r")
    root = tmp_path / "r" / "checkpoints"
    (root / "step_000012").rename(root / "step_000012.old-4242")
    (root / "step_000012.tmp-4242").mkdir()  # and the half-written successor
    plan = choose_checkpoint(load_config(RECIPE, args(tmp_path, "r", "run.resume=true")))
    assert plan.checkpoint == root / "step_000012" and plan.checkpoint.is_dir()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000010", "step_000012"]
