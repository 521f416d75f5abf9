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
@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
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


def test_self_times_from_raw_events_match_the_profilers_own():
    """``op_times`` reads self time from the raw events (``prof.events()`` ran the 100 M x 1024 cell out of
    memory). Oracle: torch's ``FunctionEvent.self_cpu_time_total`` of the same profile, op by op, on a small
    forward and backward (ops nested three deep) with a phase range around part of it."""
    from collections import defaultdict

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_profile import op_times, phase_tables

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    x = torch.randn(128, 64)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.randn(256, 256).softmax(-1).sum()  # outside the phase: in the totals, not in its table
        with record_function("unirl.train"):
            for _ in range(5):
                model(x).square().mean().backward()
    ops = op_times(prof.profiler.kineto_results.events())
    mine, theirs = defaultdict(float), defaultdict(float)
    for name, _, _, own in ops:
        mine[name] += own / 1e3
    for e in prof.events():
        theirs[e.name] += e.self_cpu_time_total
    assert set(mine) == set(theirs) and "aten::addmm" in mine and "aten::softmax" in mine
    for name, us in theirs.items():
        assert abs(mine[name] - us) <= 2 + 0.01 * us, (name, mine[name], us)  # us rounding per event
    table = phase_tables(ops, rows=50)
    assert table[0].startswith("unirl.train:") and any("aten::addmm" in row for row in table)
    assert not any("softmax" in row for row in table)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_phase_profiles_that_phase_of_the_last_step_only():
    """``--phase rollout`` (how the 1024-token cells are profiled): one table, the rollout's, whose wall is
    the last step's rollout time printed beside it."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_profile.py"), "--size", "3m",
                           "--length", "64", "--threads", "1", "--steps", "2", "--phase", "rollout"],
                          capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert re.findall(r"^(unirl\.\w+): [\d.]+ ms wall", out, re.MULTILINE) == ["unirl.rollout"], out
    assert "the rollout phase of the last step" in out and re.search(r"^\s+aten::mm\s", out, re.MULTILINE), out
    wall_ms = float(re.search(r"^unirl\.rollout: ([\d.]+) ms wall", out, re.MULTILINE)[1])
    rollout_s = float(re.search(r"last step: rollout ([\d.]+) s", out)[1])
    # the profiled range lies inside the phase's timer, which also holds the profiler's start and stop
    assert 0.5 * rollout_s < wall_ms / 1e3 <= rollout_s, (wall_ms, rollout_s)
