"""Issue 66, "never destroy what UniRL did not write": ``make dist DIST_DIR=dir`` used to start with
``rm -rf dir``; now it goes through core's output rule (:mod:`unirl.outputs`, ``python -m unirl.outputs``),
and that rule's ``--force`` removes only UniRL's own files (the marker lists them).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from unirl.outputs import MARKER, OutputExistsError, claim_output_dir, mark_output_dir, replace_output_dir

ROOT = Path(__file__).resolve().parents[2]
USER = b"my wheel notes \x00\xff\n"


def test_make_dist_refuses_a_users_directory_and_leaves_it_byte_for_byte(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.bin").write_bytes(USER)
    made = subprocess.run(["make", "-s", "-C", str(ROOT), "dist", f"DIST_DIR={mine}"], capture_output=True,
                          text=True, timeout=300)
    assert made.returncode != 0
    errors = [line for line in made.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in made.stderr, made.stderr
    assert f"DIST_DIR {mine}" in errors[0] and "UniRL did not write" in errors[0] and "new directory" in errors[0]
    assert (mine / "notes.bin").read_bytes() == USER and [p.name for p in mine.iterdir()] == ["notes.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"], "nothing staged beside it"


def outputs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unirl.outputs", *args], capture_output=True, text=True, timeout=60)


def staged(parent: Path, **files: bytes) -> Path:
    s = parent / ".stage"
    s.mkdir()
    for name, data in files.items():
        (s / name).write_bytes(data)
    return s


def test_an_earlier_dist_is_replaced_file_by_file_and_a_users_addition_stays(tmp_path):
    """What the Makefile runs after building: the first output is marked, the next replaces exactly its
    own files (an old wheel goes) and keeps a file the user put there."""
    dist = tmp_path / "dist"
    assert outputs("claim", str(dist), "dist", "DIST_DIR").returncode == 0
    assert outputs("replace", str(staged(tmp_path, **{"a-1.whl": b"1", "a-1.tar.gz": b"1"})), str(dist), "dist",
                   "DIST_DIR").returncode == 0
    assert json.loads((dist / MARKER).read_text())["files"] == ["a-1.tar.gz", "a-1.whl"]
    (dist / "notes.bin").write_bytes(USER)
    assert outputs("claim", str(dist), "dist", "DIST_DIR").returncode == 0  # an earlier dist: allowed
    done = outputs("replace", str(staged(tmp_path, **{"a-2.whl": b"2"})), str(dist), "dist", "DIST_DIR")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in dist.iterdir()) == sorted(["a-2.whl", MARKER, "notes.bin"])
    assert (dist / "notes.bin").read_bytes() == USER and not (tmp_path / ".stage").exists()


def test_force_writes_beside_a_users_files_never_over_them(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.bin").write_bytes(USER)
    with pytest.raises(OutputExistsError, match="--force to write beside them; they are kept"):
        claim_output_dir(mine, kind="export", field="--out")
    s = staged(tmp_path, **{"config.json": b"{}"})
    mark_output_dir(s, "export")
    replace_output_dir(s, mine, kind="export", field="--out", force=True)
    assert (mine / "notes.bin").read_bytes() == USER and (mine / "config.json").read_bytes() == b"{}"
    (mine / MARKER).unlink()  # now config.json is no longer known as UniRL's
    s = staged(tmp_path, **{"config.json": b"{new}"})
    mark_output_dir(s, "export")
    with pytest.raises(OutputExistsError, match="config.json is not a file UniRL wrote"):
        replace_output_dir(s, mine, kind="export", field="--out", force=True)
    assert (mine / "config.json").read_bytes() == b"{}" and not s.exists()
    afile = tmp_path / "afile"
    afile.write_bytes(USER)
    with pytest.raises(OutputExistsError, match="--force included"):
        claim_output_dir(afile, kind="export", field="--out", force=True)
    assert afile.read_bytes() == USER
