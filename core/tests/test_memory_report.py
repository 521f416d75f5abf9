"""The per-phase memory report (issue 65 item 4): each phase's peak RSS, measured by the process's meter
(:mod:`unirl.memory`) at the phase's end (:mod:`unirl.trainer.memory`), in metrics.jsonl, memory.json
and the closing table. The oracle for a peak is a known allocation against the process's RSS read
independently (``/proc/self/status`` VmRSS) just before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from unirl.config import load_config
from unirl.kernel import load_kernel
from unirl.memory import PeakMeter, current_rss_mb
from unirl.trainer import phases
from unirl.trainer.memory import MemoryRecorder
from unirl.trainer.report import memory_table

ROOT = Path(__file__).resolve().parents[2]
BALLAST_MB = 200


def ballast() -> None:
    """Allocate and touch BALLAST_MB, then free it: only a peak can show it."""
    t = torch.ones(BALLAST_MB * (1 << 20) // 4, dtype=torch.float32)
    assert float(t[-1]) == 1.0
    del t


@pytest.mark.parametrize("sampled", [False, True], ids=["high-water-mark", "sampled"])
def test_a_phase_that_allocates_200_mb_peaks_200_mb_above_where_it_started_and_the_next_does_not(sampled):
    meter = PeakMeter(force_sampling=sampled, interval_s=0.002)
    assert meter.method == ("sampled" if sampled else "hwm")  # clear_refs works here (Linux, root or own process)
    try:
        recorder, timings = MemoryRecorder(meter), {}
        with phases.recording(recorder):
            base = current_rss_mb()
            with phases.phase("train", timings):
                ballast()
                if sampled:  # the sampler must see the allocation: hold it one interval longer
                    t = torch.ones(BALLAST_MB * (1 << 20) // 4)
                    import time

                    time.sleep(0.05)
                    del t
            quiet_base = current_rss_mb()
            with phases.phase("sync", timings):
                pass
        assert timings["mem/train_peak_mb"] >= base + BALLAST_MB * 0.95
        # the mark restarted at the phase's start: a quiet phase does not inherit the ballast
        assert timings["mem/sync_peak_mb"] < quiet_base + BALLAST_MB / 2
        assert not any("rank" in k for k in timings)  # no actor attached: no ranks of its own
        assert round(recorder.table["train"].rss_mb, 1) == timings["mem/train_peak_mb"]
    finally:
        meter.close()


def test_a_nested_phase_keeps_the_outer_phase_peak_and_a_failed_phase_is_closed():
    meter = PeakMeter()
    recorder, outer, inner = MemoryRecorder(meter), {}, {}
    with phases.recording(recorder):
        base = current_rss_mb()
        with phases.phase("export", outer):
            ballast()  # before the inner phase resets the mark
            with phases.phase("sync", inner):
                pass
        with pytest.raises(ValueError), phases.phase("train", {}):
            raise ValueError
        assert recorder.open == []
    assert outer["mem/export_peak_mb"] >= base + BALLAST_MB * 0.95
    assert inner["mem/sync_peak_mb"] < base + BALLAST_MB / 2
    assert phases._recorder is None
    with phases.recording(recorder), pytest.raises(RuntimeError, match="already active"), \
            phases.recording(recorder):
        pass


def test_a_run_reports_every_phase_in_metrics_memory_json_and_a_table(tmp_path, capsys):
    from unirl.trainer.loop import train

    config = load_config(ROOT / "recipes" / "arith-tiny.yaml", [
        "sft.steps=0", "trainer.steps=2", "trainer.prompts_per_step=2", "trainer.eval_every=0",
        "trainer.plot=false", "trainer.save_every=1", "data.arith.n_train=16", "data.arith.n_eval=4",
        "rollout.n=2", "rollout.max_new_tokens=2", "model.build={hidden_size: 32, intermediate_size: 64}",
        f"run.output_dir={tmp_path}"])
    result = train(config, load_kernel())
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    rss = current_rss_mb()
    first, steps = rows[0], [r for r in rows if r["step"] > 0]
    assert first["step"] == 0 and {"mem/load_peak_mb", "mem/first_sync_peak_mb"} <= set(first)
    for row in steps:
        for name in ("rollout", "replay", "train", "sync"):
            # a process that holds torch and a model: more than 100 MB, no more than the machine
            assert 100 < row[f"mem/{name}_peak_mb"] < 2 * max(rss, first["mem/load_peak_mb"]) + 1024
    assert "mem/checkpoint_peak_mb" in steps[1]  # the checkpoint after step 1, in the next row
    assert not any("rank" in k for r in rows for k in r)  # the embedded actor has no processes of its own
    doc = json.loads((result.run_dir / "memory.json").read_text())
    assert doc["method"] == "hwm"
    assert set(doc["phases"]) == {"load", "first_sync", "rollout", "replay", "train", "sync", "checkpoint", "export"}
    assert doc["phases"]["train"]["trainer_rss_mb"] == max(r["mem/train_peak_mb"] for r in steps)
    out = capsys.readouterr().out
    assert "peak memory per phase" in out and "export" in out.split("peak memory per phase")[1]


def test_the_table_has_a_column_per_rank_and_their_sum():
    from unirl.memory import MemoryPeak

    class TwoRanks:
        def __init__(self):
            self.calls = 0

        def memory_peaks(self):
            self.calls += 1
            return [MemoryPeak(1000.0 + self.calls), MemoryPeak(2000.0)]

    recorder = MemoryRecorder()
    recorder.attach(TwoRanks())
    timings: dict[str, float] = {}
    with phases.recording(recorder), phases.phase("train", timings):
        pass
    assert timings["mem/train_peak_mb_rank0"] == 1001.0 and timings["mem/train_peak_mb_rank1"] == 2000.0
    assert timings["mem/train_peak_mb_ranks_sum"] == 3001.0
    table = memory_table(recorder).splitlines()
    assert table[0].split() == ["phase", "trainer", "rank0", "rank1", "ranks", "sum"]
    assert table[1].split()[0] == "train" and table[1].split()[2:] == ["1001", "2000", "3001"]
