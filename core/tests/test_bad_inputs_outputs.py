"""Issue 42, outputs: a path the user names is never deleted or overwritten unless UniRL wrote it, and
the eval / resume inputs that used to pass silently are errors, before any model is built.

Through the real CLI entry in-process (``unirl.cli.main``): exit 2, one ``error:`` line naming the
field, the value and the fix, no traceback, and the user's file byte for byte as it was.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from unirl import cli
from unirl.config import load_config
from unirl.evaluation import is_eval_output
from unirl.outputs import MARKER, OutputExistsError, claim_output_file
from unirl.trainer.run_dir import NOT_STARTED, prepare_run_dir

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "arith-tiny.yaml")
TINY = [
    "sft.steps=0", "trainer.steps=2", "trainer.save_every=1", "trainer.prompts_per_step=2", "trainer.eval_every=0",
    "trainer.eval_k=1", "trainer.progress=false", "trainer.plot=false", "data.arith.n_train=16",
    "data.arith.n_eval=2", "rollout.n=2", "rollout.max_new_tokens=2",
    "model.build={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1}",
]
USER_BYTES = b"my notes \x00\xff, not UniRL's\n"


def args(out: Path, name: str, *extra: str) -> list[str]:
    return [f"run.output_dir={out}", f"run.name={name}", *TINY, *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny trained run: checkpoints at steps 1 and 2, and the hf/ a finished run exports."""
    out = tmp_path_factory.mktemp("outputs")
    assert cli.main(["train", RECIPE, *args(out, "r", "trainer.export_hf=true")]) == 0
    assert (out / "r" / "hf" / MARKER).is_file(), "a run's hf/ is marked as an export"
    return out / "r"




def main(argv: list[str], capsys) -> tuple[int, str]:
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out + out.err


def refused(code: int, text: str, *words: str) -> None:
    assert code == 2, text
    assert "Traceback" not in text
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"one problem, one line:\n{text}"
    missing = [w for w in words if w not in text]
    assert not missing, f"the message lacks {missing}:\n{text}"


def user_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "notes.bin").write_bytes(USER_BYTES)
    return path


# ------------------------------------------------------------------------------------------- export


def test_export_refuses_a_directory_holding_a_users_file(run, tmp_path, no_model, capsys):
    dest = user_dir(tmp_path / "mine")
    code, text = main(["export", str(run), "--out", str(dest)], capsys)
    refused(code, text, "--out", str(dest), "UniRL did not write", "empty or new directory", "--force")
    assert sorted(p.name for p in dest.iterdir()) == ["notes.bin"]
    assert (dest / "notes.bin").read_bytes() == USER_BYTES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"], "no staging left behind"


def test_export_refuses_a_file_and_the_run_itself(run, tmp_path, no_model, capsys):
    (tmp_path / "f").write_bytes(USER_BYTES)
    code, text = main(["export", str(run), "--out", str(tmp_path / "f")], capsys)
    refused(code, text, "--out", "is a file", "choose another path")
    assert (tmp_path / "f").read_bytes() == USER_BYTES
    code, text = main(["export", str(run), "--out", str(run.parent), "--force"], capsys)
    refused(code, text, "--out", "holds the run directory", "choose another directory")


def test_export_over_an_earlier_export_then_force_over_a_users_directory(run, tmp_path, capsys):
    hf = run / "hf"  # the default --out: the run's own export, replaced by the export of step 1
    code, text = main(["export", str(run), "--step", "1"], capsys)
    assert code == 0, text
    assert json.loads((hf / MARKER).read_text())["checkpoint"] == "step_000001"
    dest = tmp_path / "out"
    assert main(["export", str(run), "--out", str(dest)], capsys)[0] == 0
    assert main(["export", str(run), "--out", str(dest)], capsys)[0] == 0  # an earlier export: replaced
    assert (dest / "config.json").is_file() and (dest / "model.safetensors").is_file()
    mine = user_dir(tmp_path / "mine")  # --force writes beside the user's files and keeps them
    code, text = main(["export", str(run), "--out", str(mine), "--force"], capsys)
    assert code == 0, text
    assert (mine / "notes.bin").read_bytes() == USER_BYTES and (mine / MARKER).is_file()
    assert (mine / "model.safetensors").is_file() and "notes.bin" not in json.loads((mine / MARKER).read_text())["files"]
    (dest / "README.md").write_bytes(USER_BYTES)  # added to an earlier export: the next export keeps it
    assert main(["export", str(run), "--out", str(dest)], capsys)[0] == 0
    assert (dest / "README.md").read_bytes() == USER_BYTES
    (mine / "config.json").unlink()  # a user's file with a name the export writes: refused, --force included
    (mine / "config.json").write_bytes(USER_BYTES)
    marker = (mine / MARKER).read_text()
    (mine / MARKER).unlink()
    refused(*main(["export", str(run), "--out", str(mine), "--force"], capsys), "config.json", "left untouched")
    assert (mine / "config.json").read_bytes() == USER_BYTES
    (mine / MARKER).write_text(marker)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out"], "no staging left behind"


# --------------------------------------------------------------------------------------------- eval


def eval_argv(tmp_path: Path, *extra: str) -> list[str]:
    return ["eval", RECIPE, *args(tmp_path, "e"), *extra]


@pytest.mark.parametrize(("extra", "words"), [
    (["--k", "0"], ["--k 0", "at least one sample", "--k 1 or more", "trainer.eval_k=1"]),
    (["--k", "-3"], ["--k -3", "--k 1 or more"]),
    (["--threshold", "5"], ["--threshold 5", "[0, 1]", "pass@k would be 0", "fix: choose a threshold in (0, 1]"]),
    (["--threshold", "0"], ["--threshold 0", "[0, 1]", "pass@k would be 1", "--threshold 1"]),
    (["--threshold", "nan"], ["--threshold nan", "not a finite number", "fix:"]),
    (["--threshold", "2", "reward.name=weighted", "reward.terms={exact_int: 0.5, math_verify: 1}"],
     ["--threshold 2", "reward weighted scores in [0, 1.5]", "(0, 1.5]"]),
])
def test_eval_bad_k_and_threshold(extra, words, tmp_path, no_model, capsys):
    code, text = main(eval_argv(tmp_path, *extra), capsys)
    refused(code, text, *words)
    assert not (tmp_path / "e").exists()


def test_eval_refuses_a_users_file_and_a_directory_as_out(tmp_path, no_model, capsys):
    mine = tmp_path / "mine.jsonl"
    mine.write_bytes(USER_BYTES)
    code, text = main(eval_argv(tmp_path, "--out", str(mine)), capsys)
    refused(code, text, f"--out {mine}", "not a per-prompt eval JSONL", "choose another path", "--force")
    assert mine.read_bytes() == USER_BYTES
    other = tmp_path / "other.jsonl"  # JSON lines, but not an eval's
    other.write_text('{"prompt": "Q", "answer": "1"}\n')
    refused(*main(eval_argv(tmp_path, "--out", str(other)), capsys), "--out", "--force")
    code, text = main(eval_argv(tmp_path, "--out", str(tmp_path)), capsys)
    refused(code, text, "--out", "is a directory", "name a file path")
    code, text = main(eval_argv(tmp_path, "--out", str(mine / "x.jsonl")), capsys)
    refused(code, text, "--out", "is a file, not a directory")
    assert not (tmp_path / "e").exists() and mine.read_bytes() == USER_BYTES


def test_eval_of_no_model_path_says_so_first_and_force_overwrites(tmp_path, capsys):
    mine = tmp_path / "mine.jsonl"
    mine.write_bytes(USER_BYTES)
    code = cli.main(eval_argv(tmp_path, "--out", str(mine), "--force", "--k", "1"))
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.err.splitlines()[0] == (
        "note: model.path is not set: evaluating a freshly initialised (untrained) model; set model.path=DIR "
        "(e.g. a `unirl export` output) to evaluate a trained one")
    rows = [json.loads(line) for line in mine.read_text().splitlines()]
    assert len(rows) == 2 and all(len(r["completions"]) == 1 for r in rows)
    assert is_eval_output(mine)  # so the next eval may replace it without --force
    assert claim_output_file(mine, field="--out", is_ours=is_eval_output, what="x") == mine


def test_is_eval_output_recognises_only_its_own_rows(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps({k: None for k in ("prompt_id", "prompt", "answer", "completions", "rewards",
                                               "mean_reward", "pass")}) + "\n")
    assert is_eval_output(p)
    p.write_text("[1, 2]\n")
    assert not is_eval_output(p)
    p.write_bytes(b"")
    assert is_eval_output(p)  # empty: nothing to lose
    p.write_bytes(USER_BYTES)
    with pytest.raises(OutputExistsError, match="--force"):
        claim_output_file(p, field="--out", is_ours=is_eval_output, what="per-prompt eval JSONL")


# ------------------------------------------------------------------------------ resume and run dirs


def test_resume_past_trainer_steps_is_an_error_before_any_model(run, tmp_path, no_model, capsys):
    shutil.copytree(run, tmp_path / "r")
    code, text = main(["train", RECIPE, *args(tmp_path, "r", "trainer.steps=1", "run.resume=true")], capsys)
    refused(code, text, "trainer.steps=1", "step_000002", "at step 2", "nothing left to train",
            "raise trainer.steps above 2", "run.resume=false")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_resuming_a_finished_run_says_it_is_complete(run, tmp_path):
    """A checkpoint exactly at trainer.steps (``run.resume=auto`` in a script that re-runs) is not an
    error: the run says plainly that it is complete and that there is nothing to train."""
    from unirl.trainer.run_dir import prepare_run_dir

    shutil.copytree(run, tmp_path / "r")
    notes: list[str] = []
    plan = prepare_run_dir(load_config(RECIPE, args(tmp_path, "r", "run.resume=auto")), notes.append)
    assert plan.checkpoint is not None and plan.checkpoint.name == "step_000002"
    assert any("is complete" in n and "nothing to train" in n and "raise trainer.steps" in n for n in notes), notes


def test_a_fresh_run_keeps_a_users_file_in_an_earlier_run_byte_for_byte(tmp_path):
    config = load_config(RECIPE, args(tmp_path, "r"))
    run = config.run_dir
    run.mkdir()
    (run / "config.yaml").write_text("run: {}\n")
    (run / "notes.bin").write_bytes(USER_BYTES)
    said: list[str] = []
    prepare_run_dir(config, said.append)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("r.")]
    assert len(kept) == 1 and (kept[0] / "notes.bin").read_bytes() == USER_BYTES
    assert said[0].startswith(f"kept the previous run in {kept[0]}")


def test_a_never_started_run_holding_a_users_file_is_kept_not_deleted(tmp_path):
    config = load_config(RECIPE, args(tmp_path, "r"))
    run = config.run_dir
    run.mkdir()
    (run / NOT_STARTED).write_text("")
    (run / "config.yaml").write_text("run: {}\n")
    (run / "notes.bin").write_bytes(USER_BYTES)
    said: list[str] = []
    prepare_run_dir(config, said.append)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("r.")]
    assert len(kept) == 1 and (kept[0] / "notes.bin").read_bytes() == USER_BYTES
    (run / "config.yaml").write_text("run: {}\n")  # only run files: replaced, as before
    said.clear()
    prepare_run_dir(config, said.append)
    assert said == [f"replaced {run}, left by a run that never started training"]


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_run_refuses_a_directory_that_is_no_run(tmp_path, no_model, capsys, command):
    mine = user_dir(tmp_path / "r")
    code, text = main([command, RECIPE, *args(tmp_path, "r", "sft.steps=1")], capsys)
    refused(code, text, str(mine), "not a UniRL run directory", "left untouched", "set run.name or run.output_dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"], "not renamed either"
    assert sorted(p.name for p in mine.iterdir()) == ["notes.bin"]
    assert (mine / "notes.bin").read_bytes() == USER_BYTES


# ------------------------------------------------------------------------- unwritable outputs (issue 66)
# Root ignores permission bits, so "read-only" here is a read-only tmpfs the test mounts (as CI runs, as root).


@pytest.fixture
def read_only(tmp_path):
    import subprocess

    where = tmp_path / "ro"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_read_only_or_file_parented_output_dir_is_a_preflight_line_before_any_model(read_only, tmp_path, no_model,
                                                                                      capsys):
    for cmd in ("train", "sft", "preflight"):
        code, text = main([cmd, RECIPE, *TINY, "sft.steps=1", f"run.output_dir={read_only / 'runs'}"], capsys)
        refused(code, text, "run.output_dir", str(read_only), "read-only", "EROFS", "writable directory")
    afile = tmp_path / "afile"
    afile.write_bytes(USER_BYTES)
    code, text = main(["train", RECIPE, *TINY, f"run.output_dir={afile / 'runs'}"], capsys)
    refused(code, text, "run.output_dir", f"{afile} is a file")
    assert afile.read_bytes() == USER_BYTES


def test_export_and_eval_out_on_a_read_only_path_fail_before_any_model(run, read_only, no_model, capsys):
    code, text = main(["export", str(run), "--out", str(read_only / "model")], capsys)
    refused(code, text, "--out", str(read_only / "model"), "read-only", "writable disk")
    code, text = main(eval_argv(read_only.parent, "--out", str(read_only / "e.jsonl")), capsys)
    refused(code, text, "--out", str(read_only / "e.jsonl"), "read-only", "writable disk")


def test_export_and_eval_out_on_a_full_disk_fail_before_any_model(run, tmp_path, no_model, capsys):
    """A disk with room for the probe but not for the export's weights (a size known first), and a disk
    with no room at all: one line each, before any model is built."""
    import subprocess

    weights = (run / "checkpoints" / "step_000002" / "model.safetensors").stat().st_size
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={weights - 16 * 1024}", "tmpfs", str(small)], check=True)
    try:
        code, text = main(["export", str(run), "--out", str(small / "model")], capsys)
        refused(code, text, "--out", str(small / "model"), "the export needs about", "MB free", "bigger disk")
        (small / "filler").write_bytes(b"\0" * (weights - 16 * 1024 - 4096))
        code, text = main(eval_argv(tmp_path, "--out", str(small / "e.jsonl")), capsys)
        refused(code, text, "--out", str(small / "e.jsonl"), "disk is full", "ENOSPC")
        assert sorted(p.name for p in small.iterdir()) == ["filler"]
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
