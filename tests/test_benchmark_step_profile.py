"""``benchmarks/step_profile.py`` on the smallest cell, so the script cannot rot (issue 38): one table per
phase, taken from the trainer's ``torch.profiler`` ranges, with the matmuls where they must be."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_profile_prints_a_table_per_phase_with_the_matmuls_in_train_and_rollout():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_profile.py"), "--size", "3m",
                           "--length", "64", "--threads", "1", "--rows", "40", "--steps", "1"],
                          capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    heads = re.findall(r"^(unirl\.\w+): [\d.]+ ms wall", out, re.MULTILINE)
    assert heads == ["unirl.rollout", "unirl.replay", "unirl.train", "unirl.sync"], out
    train = out.split("unirl.train:")[1].split("unirl.sync:")[0]
    rollout = out.split("unirl.rollout:")[1].split("unirl.replay:")[0]
    assert re.search(r"^\s+aten::mm\s", train, re.MULTILINE), train  # forward and backward matmuls
    assert "backward" in train.lower() and "backward" not in rollout.lower()  # no grad while generating
    assert re.search(r"train phase: [\d.]+ GFLOP/s = \d+% of a plain fp32 mm", out), out
