"""``unirl.fsio``: the one atomic file write and the one directory swap; ``violations_from``, the one
``ValidationError`` converter. Each test would fail if a writer could leave a torn file, a temp file, or
a half-swapped directory behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from unirl.api import (
    atomic_write,
    atomic_write_json,
    atomic_write_with,
    swap_dir,
    violations_from,
    weight_buckets,
)
from unirl.fsio import temp_sibling

ROOT = Path(__file__).resolve().parents[2]


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    target = tmp_path / "sub" / "f.json"
    atomic_write_json(target, {"a": 1})
    atomic_write_json(target, {"a": 2})
    assert target.read_text() == '{"a": 2}\n'
    assert [p.name for p in target.parent.iterdir()] == ["f.json"]
    atomic_write(target, b"bytes")
    assert target.read_bytes() == b"bytes"


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "f.txt"
    atomic_write(target, "old")
    with pytest.raises(TypeError):
        atomic_write(target, 123)  # type: ignore[arg-type] - fails inside the write, after the temp exists
    assert target.read_text() == "old"
    assert not temp_sibling(target).exists() and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_swap_dir_moves_the_old_copy_aside_then_swaps(tmp_path):
    dest, new = tmp_path / "out", tmp_path / "out.tmp-1"
    dest.mkdir()
    (dest / "v").write_text("1")
    new.mkdir()
    (new / "v").write_text("2")
    seen = []
    swap_dir(new, dest, between=lambda: seen.append(sorted(p.name for p in tmp_path.iterdir())))
    assert (dest / "v").read_text() == "2" and not new.exists()
    (between,) = seen  # between the renames: the old copy aside, the new one not yet in
    assert "out" not in between and "out.tmp-1" in between and any(n.startswith("out.old-") for n in between)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old copy is deleted after


def test_a_failed_swap_puts_the_old_directory_back(tmp_path):
    dest, new = tmp_path / "out", tmp_path / "out.tmp-1"
    dest.mkdir()
    (dest / "v").write_text("1")
    new.mkdir()

    def boom():
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        swap_dir(new, dest, between=boom)
    assert (dest / "v").read_text() == "1" and new.exists()


def test_violations_from_names_each_field_under_the_prefix():
    class Opts(BaseModel):
        model_config = ConfigDict(extra="forbid")
        batch_size: int = 1

    with pytest.raises(Exception) as info:
        Opts.model_validate({"batch_size": "x", "typo": 1})
    got = violations_from(info.value, "my-dist", "rollout.options", "see Opts")
    assert sorted(v.field for v in got) == ["rollout.options.batch_size", "rollout.options.typo"]
    assert all(v.source == "my-dist" and v.fix == "see Opts" for v in got)


def test_core_fsyncs_only_through_fsio():
    """One fsync rule: a writer in core that calls ``os.fsync`` itself has its own rule again."""
    bad = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "core" / "src").rglob("*.py")) if p.name != "fsio.py"
           for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bos\.fsync\(", line)]
    assert not bad, "use unirl.fsio (atomic_write / fsync_file / fsync_dir) instead:\n" + "\n".join(bad)


def test_atomic_write_with_lets_a_library_write_the_temp_and_fails_clean(tmp_path):
    """A library that writes files itself (``savefig``, ``save_file``) goes through the same rule; a
    writer that raises midway leaves the old file and no temp behind."""
    target = tmp_path / "plot.png"
    atomic_write_with(target, lambda tmp: tmp.write_bytes(b"v1"))
    assert target.read_bytes() == b"v1"

    def torn(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic_write_with(target, torn)
    assert target.read_bytes() == b"v1" and [p.name for p in tmp_path.iterdir()] == ["plot.png"]


def test_weight_buckets_bound_each_bucket_and_keep_order():
    """Each bucket holds at most ``limit`` bytes unless one tensor alone is larger; names keep their order."""
    import torch

    tensors = [(f"w{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([4, 4, 10, 1, 1, 2])]
    got = list(weight_buckets(iter(tensors), 32))  # 32 bytes = 8 floats
    assert [[n for n, _ in b] for b in got] == [["w0", "w1"], ["w2"], ["w3", "w4", "w5"]]
    assert list(weight_buckets([], 32)) == []


def test_engine_init_dir_saves_the_seeded_model_once_or_uses_model_path(tmp_path):
    """Without ``model.path`` the adapter's seeded model and tokenizer are saved under the run dir (what a
    server engine starts from); with it nothing is written."""
    from unirl.api import engine_init_dir, load_config, load_kernel

    config = load_config(None, [f"run.output_dir={tmp_path}", "run.name=run"])
    adapter = load_kernel().build("model_adapters", config.model.adapter)
    path, tok = engine_init_dir(config, adapter)
    assert Path(path) == tmp_path / "run" / "engine_init" and (Path(path) / "config.json").is_file()
    assert tok is not None and (Path(path) / "tokenizer.json").is_file()
    given = load_config(None, [f"model.path={path}"])
    assert engine_init_dir(given, adapter, tok) == (path, tok)


def test_plugins_fsync_only_through_fsio():
    """The same rule for every plugin: they import the write from ``unirl.api``."""
    bad = [f"{p.relative_to(ROOT)}:{n}" for p in sorted(ROOT.glob("plugins/*/src/**/*.py"))
           for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bos\.fsync\(", line)]
    assert not bad, "use unirl.api's atomic_write / atomic_write_with / swap_dir / fsync_file:\n" + "\n".join(bad)
