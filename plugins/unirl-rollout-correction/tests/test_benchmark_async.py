"""``benchmarks/correction_async.py --quick`` end to end: every arm runs, the table and the last line
have their shape, the staleness is real (async batches disagree with pi_old, sync ones do not), the
correction really reweights, and the PNG is written. No efficacy assertion: a 4-step run proves the
machinery, the numbers are in benchmarks/README.md."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ROW = re.compile(r"^(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\.\.([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
                 r"\s+([\d.]+)\s+(\d+)$")


@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_mode_runs_every_arm_and_ends_with_the_gap_closed(tmp_path):
    png = tmp_path / "curves.png"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "correction_async.py"), "--quick",
                           "--png", str(png)], capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"gap closed: (-?\d+\.\d\d|n/a \(.*\))", lines[-1]), lines[-1]
    rows = {m[1]: [float(x) for x in m.groups()[1:]] for m in map(ROW.match, lines) if m}
    assert set(rows) == {"sync", "async-2", "2+token_tis"}, lines
    mean, sd, lo, hi, ess_g, ess_m, trunc, dlogp, kl, _ = range(10)
    for r in rows.values():
        assert 0 <= r[lo] <= r[mean] <= r[hi] <= 1 and r[sd] >= 0
    assert rows["sync"][dlogp] < 1e-3  # on-policy: the engine's log-probs are pi_old's
    assert rows["async-2"][dlogp] > 1e-2 and rows["async-2"][kl] > 0  # stale batches: a real mismatch
    assert rows["async-2"][ess_g] == 1.0 and rows["async-2"][trunc] == 0.0  # uncorrected: weights untouched
    assert rows["2+token_tis"][ess_g] < 1.0 and rows["2+token_tis"][trunc] > 0  # the cap bit
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
