"""``unirl parity report`` on input it cannot use: one message naming the file, the field and the fix,
exit 2, no traceback; and a ``--png`` path never overwrites a file this command did not write."""

from __future__ import annotations

import copy
import json

import pytest

from unirl.cli import main
from unirl_parity_vllm.artifact import SCHEMA
from unirl_parity_vllm.gate import HIST_BINS
from unirl_parity_vllm.report import PLOT_MARK

PHASE = {"passed": False, "tokens": 64, "mismatches": 3, "max_abs_diff": 1e-6, "k3": 0.0, "steps": [0],
         "weight_versions": [1], "hist": [61, 3] + [0] * (HIST_BINS - 2)}
ARTIFACT = {"schema": SCHEMA, "verdict": "fail", "phases": {"initial_checkpoint": PHASE},
            "run": {"name": "r"}, "weights": [{"version": 1, "receipts": []}], "runtime": {"packages": {}}}


def _write(tmp_path, doc, name="artifact.json"):
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def _without(path: str) -> dict:
    doc = copy.deepcopy(ARTIFACT)
    *parents, last = path.split(".")
    obj = doc
    for k in parents:
        obj = obj[k]
    del obj[last]
    return doc


def _with(path: str, value) -> dict:
    doc = copy.deepcopy(ARTIFACT)
    *parents, last = path.split(".")
    obj = doc
    for k in parents:
        obj = obj[k]
    obj[last] = value
    return doc


@pytest.mark.parametrize(("doc", "words"), [
    ([ARTIFACT], "a JSON list, not a parity artifact (an object with schema 'unirl.parity.artifact/v1')"),
    (_without("phases.initial_checkpoint.passed"), "phases.initial_checkpoint.passed is missing (expected a boolean)"),
    (_with("phases.initial_checkpoint.passed", "yes"), "phases.initial_checkpoint.passed is a JSON string, expected a boolean"),
    (_with("phases.initial_checkpoint.tokens", None), "phases.initial_checkpoint.tokens is a JSON null, expected an integer"),
    (_with("phases.initial_checkpoint.hist", [0]), f"phases.initial_checkpoint.hist has 1 bins, expected {HIST_BINS}"),
    (_with("phases", []), "phases is a JSON list, expected an object"),
    (_without("verdict"), "verdict is missing (expected a string)"),
    (_with("schema", "other/v9"), "schema is 'other/v9', this report reads 'unirl.parity.artifact/v1'"),
    (_with("weights", [{"receipts": []}]), "weights[0].version is missing (expected an integer)"),
    ('{"schema": "unirl.parity.artifact/v1", "verd', "not valid JSON"),
])
def test_a_bad_artifact_is_named_with_the_field_and_the_fix(tmp_path, capsys, doc, words):
    path = _write(tmp_path, doc)
    assert main(["parity", "report", str(path)]) == 2
    err = _error(capsys)
    assert f"parity artifact {path}: " in err and words in err
    assert "fix: pass the artifact.json a parity run wrote (RUN_DIR/parity/artifact.json" in err
    assert capsys.readouterr().out == ""  # nothing rendered
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact.json"]  # no histogram written


def test_a_missing_artifact_names_where_it_was_looked_for(tmp_path, capsys):
    assert main(["parity", "report", str(tmp_path)]) == 2
    err = _error(capsys)
    assert f"cannot read parity artifact {tmp_path / 'artifact.json'}: No such file" in err and "fix: " in err


def test_a_users_file_at_the_png_path_survives(tmp_path, capsys):
    path = _write(tmp_path, ARTIFACT)
    mine = tmp_path / "figure.png"
    body = b"\x89PNG\r\n\x1a\nmy own figure"
    mine.write_bytes(body)
    assert main(["parity", "report", str(path), "--png", str(mine)]) == 2
    err = _error(capsys)
    assert f"--png {mine}: the file exists and is not a parity |diff| histogram UniRL wrote" in err
    assert "fix: choose another path, or pass --force to overwrite it" in err
    assert mine.read_bytes() == body and capsys.readouterr().out == ""


def test_histograms_it_wrote_are_replaced_and_force_overrides(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = _write(tmp_path, ARTIFACT)
    default = tmp_path / "diff_hist.png"
    default.write_bytes(b"\x89PNG\r\n\x1a\nan older histogram, before the mark")  # the default path: ours
    for _ in range(2):
        assert main(["parity", "report", str(path)]) == 1  # verdict fail
    assert PLOT_MARK.encode() in default.read_bytes()
    other = tmp_path / "sub" / "hist.whatever"
    other.parent.mkdir()
    other.write_text("notes")
    assert main(["parity", "report", str(path), "--png", str(other)]) == 2
    assert main(["parity", "report", str(path), "--png", str(other), "--force"]) == 1
    assert other.read_bytes().startswith(b"\x89PNG")
    assert "verdict FAIL" in capsys.readouterr().out


def test_a_good_artifact_still_renders(tmp_path, capsys):
    ok = _with("phases.initial_checkpoint", {**PHASE, "passed": True, "mismatches": 0, "hist": [64] + [0] * (HIST_BINS - 1)})
    ok["verdict"] = "pass"
    assert main(["parity", "report", str(_write(tmp_path, ok))]) == 0
    assert "verdict PASS" in capsys.readouterr().out
    assert not (tmp_path / "diff_hist.png").exists()  # exact: no histogram
