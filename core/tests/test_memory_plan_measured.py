"""The memory plan against measurement (issue 67's acceptance): the embedded actor's predicted peak for a
25 M-parameter Qwen3, fp32 and bf16 compute, within +-20 % of the peak RSS a real ``unirl train`` measures
above the same layout's baseline (the tiny default model). benchmarks/memory_plan.py has the full table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import memory_plan as bench  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embedded_25m_within_20_percent(tmp_path, dtype) -> None:
    measured = bench.measure_cell("25M", "embedded", dtype, tmp_path) - \
        bench.measure_cell("tiny", "embedded", dtype, tmp_path)
    predicted = bench.predicted_mb("25M", "embedded", dtype)
    assert measured > 200, f"the 25 M model's memory should show ({measured:.0f} MiB)"
    assert abs(predicted - measured) <= 0.2 * measured, f"predicted {predicted:.0f} MiB, measured {measured:.0f} MiB"
