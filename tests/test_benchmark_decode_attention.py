"""``benchmarks/decode_attention.py --quick``, so the script cannot rot: one line per dtype with both
timings, the decoder's own choice (the whole cache in bf16, the slice in fp32) and the FLOP/s column,
then the ratio line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_mode_times_both_attentions_per_dtype_and_names_the_decoders_choice():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_attention.py"), "--quick"],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = re.findall(r"^\s+(\w+)\s+64 tokens: whole\s+[\d.]+, slice\s+[\d.]+ ms/step, ratio [\d.]+; the decoder "
                      r"uses (\w+); [\d.]+ GFLOP/s = \d+% of a", proc.stdout, re.MULTILINE)
    assert rows == [("bfloat16", "whole"), ("float32", "slice")], proc.stdout
    assert re.search(r"^chosen / faster: \d+\.\d\d$", proc.stdout.strip().splitlines()[-1]), proc.stdout
