"""Discovery through the real entry point, and every invalid configuration failing in preflight."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from unirl.api import PreflightError, load_config, load_kernel
from unirl.preflight import check, preflight

ROOT = Path(__file__).resolve().parents[3]
SOURCE = "unirl-rollout-correction"


def cfg(*over: str):
    return load_config(ROOT / "recipes" / "arith-tiny.yaml", list(over))


def mine(config) -> list:
    return [v for v in preflight(config, load_kernel()) if v.source == SOURCE]


def test_registered_by_entry_point_without_importing_torch():
    code = ("import json, sys; from unirl.kernel import load_kernel; k = load_kernel(); "
            "e = k.get('loss_modifiers', 'rollout_correction'); "
            "print(json.dumps([e.dist, e.factory, 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    dist, factory, torch_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert dist == SOURCE and factory == "unirl_rollout_correction.correction:rollout_correction"
    assert not torch_loaded


def test_not_selected_is_not_checked():
    assert mine(cfg()) == []


@pytest.mark.parametrize("section", [
    "{mode: none}", "{mode: token_tis, threshold: 2.0}", "{mode: seq_tis, threshold: 5}",
    "{mode: token_mask, threshold: 2.0, threshold_lower: 0.5}", "{mode: seq_mask}",
    "{mode: geo_mask, threshold: 1.001, threshold_lower: 0.999}"])
def test_valid_configurations_pass(section):
    assert mine(cfg("algorithm.modifiers=[rollout_correction]", f"plugins.rollout_correction={section}")) == []


LISTED = "algorithm.modifiers=[rollout_correction]"
BAD = [
    ("threshold 0", [LISTED, "plugins.rollout_correction={mode: token_tis, threshold: 0}"],
     "plugins.rollout_correction.threshold"),
    ("threshold < 0", [LISTED, "plugins.rollout_correction={mode: seq_tis, threshold: -1.5}"],
     "plugins.rollout_correction.threshold"),
    ("threshold NaN", [LISTED, "plugins.rollout_correction={mode: token_tis, threshold: .nan}"],
     "plugins.rollout_correction.threshold"),
    ("threshold inf", [LISTED, "plugins.rollout_correction={mode: token_mask, threshold: .inf}"],
     "plugins.rollout_correction.threshold"),
    ("TIS cap below 1", [LISTED, "plugins.rollout_correction={mode: token_tis, threshold: 0.5}"],
     "plugins.rollout_correction.threshold"),
    ("threshold not a number", [LISTED, "plugins.rollout_correction={mode: token_tis, threshold: big}"],
     "plugins.rollout_correction.threshold"),
    ("lower NaN", [LISTED, "plugins.rollout_correction={mode: seq_mask, threshold_lower: .nan}"],
     "plugins.rollout_correction.threshold_lower"),
    ("lower < 0", [LISTED, "plugins.rollout_correction={mode: seq_mask, threshold_lower: -0.1}"],
     "plugins.rollout_correction.threshold_lower"),
    ("lower above upper", [LISTED, "plugins.rollout_correction={mode: token_mask, threshold: 2, threshold_lower: 3}"],
     "plugins.rollout_correction.threshold_lower"),
    ("lower above upper, default lower", [LISTED, "plugins.rollout_correction={mode: geo_mask, threshold: 0.5}"],
     "plugins.rollout_correction.threshold_lower"),
    ("lower with a TIS mode", [LISTED, "plugins.rollout_correction={mode: token_tis, threshold_lower: 0.5}"],
     "plugins.rollout_correction.threshold_lower"),
    ("unknown mode", [LISTED, "plugins.rollout_correction={mode: tis}"], "plugins.rollout_correction.mode"),
    ("unknown field (typo)", [LISTED, "plugins.rollout_correction={mode: token_tis, treshold: 2}"],
     "plugins.rollout_correction.treshold"),
    ("mode with old_logp_source rollout", [LISTED, "algorithm.old_logp_source=rollout",
                                           "plugins.rollout_correction={mode: seq_mask}"], "algorithm.old_logp_source"),
    ("mode set, modifier not listed", ["plugins.rollout_correction={mode: token_tis}"], "algorithm.modifiers"),
    ("modifier listed, no mode", [LISTED], "plugins.rollout_correction.mode"),
    ("modifier listed, section without mode", [LISTED, "plugins.rollout_correction={threshold: 2}"],
     "plugins.rollout_correction.mode"),
    ("listed twice", ["algorithm.modifiers=[rollout_correction, rollout_correction]",
                      "plugins.rollout_correction={mode: token_tis}"], "algorithm.modifiers"),
]


@pytest.mark.parametrize(("why", "over", "field"), BAD, ids=[b[0] for b in BAD])
def test_invalid_configuration_fails_before_training(why, over, field, tmp_path, monkeypatch):
    found = mine(cfg(*over))
    assert [v.field for v in found] == [field], found
    v = found[0]
    assert v.fix and v.message and str(v).startswith(f"[{SOURCE}] {field}: ")
    # train() stops in preflight: no model is built, no run directory is created
    from unirl.api import Qwen3Adapter
    built = []
    monkeypatch.setattr(Qwen3Adapter, "build_model", lambda *a, **k: built.append(1))
    with pytest.raises(PreflightError, match=field.replace(".", r"\.")):
        check(cfg(*over, f"run.output_dir={tmp_path}"), load_kernel())
    assert built == [] and not any(tmp_path.iterdir())
