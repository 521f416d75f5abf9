"""``benchmarks/vs_trl.py --quick`` end to end, so the script cannot rot (issue 38): both sides run (real
TRL ``GRPOTrainer`` and ``unirl train``, each in a fresh process), the cell line carries finite positive
numbers and the last line is the worst ratio. No speed assertion: wall-clock limits are flaky on shared
CPUs; the numbers live in benchmarks/README.md."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NUM = r"(\d+(?:\.\d+)?)"
CELL = re.compile(rf"^cell 3m x 64 \(torch\): UniRL {NUM} s/step, TRL {NUM} s/step, ratio {NUM}, "
                  rf"UniRL train {NUM}% of mm, peak RSS UniRL {NUM} MB / TRL {NUM} MB$")


@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_mode_prints_the_cell_and_the_worst_ratio():
    if os.environ.get("CI") != "true":  # in CI the bench extra is installed: a missing trl fails
        pytest.importorskip("trl")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--quick", "--threads", "1"],  # one thread: it runs idle-class
                          capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("TRL 1.16."), lines[0]  # the pinned version, printed
    cells = [m for m in map(CELL.match, lines) if m]
    assert len(cells) == 1, lines
    unirl_s, trl_s, ratio, frac, rss_u, rss_t = map(float, cells[0].groups())
    for v in (unirl_s, trl_s, ratio, rss_u, rss_t):
        assert math.isfinite(v) and v > 0
    assert 0 < frac < 1000
    assert abs(ratio - unirl_s / trl_s) < 0.01 + 0.01 * ratio  # the ratio is the two sides' quotient
    # --quick runs one round: its one paired ratio is the cell's ratio
    rounds = [re.fullmatch(rf"  ratio per round: {NUM}", x) for x in lines]
    rounds = [float(m[1]) for m in rounds if m]
    assert len(rounds) == 1 and abs(rounds[0] - ratio) < 0.011, lines
    worst = re.fullmatch(rf"worst ratio: {NUM}", lines[-1])
    assert worst and float(worst[1]) == ratio, lines[-1]
