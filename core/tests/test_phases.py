"""A step's phases: each one timed into the metrics and marked as a profiler range by one function, and
watched through :func:`unirl.trainer.phases.observed` (how ``benchmarks/step_profile.py --phase``
profiles one phase only)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
from torch.profiler import ProfilerActivity, profile

from unirl.config import load_config
from unirl.kernel import load_kernel
from unirl.trainer import phases
from unirl.trainer.loop import train

ROOT = Path(__file__).resolve().parents[2]


def test_a_phase_is_timed_and_is_a_profiler_range_with_the_observer_inside_its_timer():
    events: list[str] = []

    @contextlib.contextmanager
    def around(name):
        events.append(f"enter {name}")
        time.sleep(0.05)  # the observer's own time is inside the phase's timer (the profiler's start is)
        yield
        events.append(f"exit {name}")

    timings: dict[str, float] = {}
    with profile(activities=[ProfilerActivity.CPU]) as prof, phases.observed(around):
        with phases.phase("train", timings):
            events.append("body")
            time.sleep(0.05)
    assert events == ["enter train", "body", "exit train"]
    assert timings["train_s"] >= 0.1
    ranges = [e for e in prof.events() if e.name == "unirl.train"]
    assert len(ranges) == 1 and 0.05 <= ranges[0].time_range.elapsed_us() / 1e6 < timings["train_s"]


def test_observed_is_undone_on_error_and_refuses_a_second_observer():
    with pytest.raises(ValueError), phases.observed(lambda name: contextlib.nullcontext()):
        raise ValueError
    assert phases._observer is None
    with phases.observed(lambda name: contextlib.nullcontext()):
        with pytest.raises(RuntimeError, match="already active"), phases.observed(lambda name: contextlib.nullcontext()):
            pass
    assert phases._observer is None
    timings: dict[str, float] = {}
    with phases.phase("sync", timings):  # no observer: just the timer and the range
        pass
    assert set(timings) == {"sync_s"}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_phase_of_every_step_goes_through_the_seam(tmp_path, mode):
    seen: list[str] = []

    @contextlib.contextmanager
    def around(name):
        seen.append(name)
        yield

    config = load_config(ROOT / "recipes" / "arith-tiny.yaml", [
        "sft.steps=0", "trainer.steps=2", "trainer.prompts_per_step=2", "trainer.eval_every=0",
        "trainer.progress=false", "trainer.plot=false", "data.arith.n_train=16", "data.arith.n_eval=4",
        "rollout.n=2", "rollout.max_new_tokens=2", "model.build={hidden_size: 32, intermediate_size: 64}",
        f"rollout.mode={mode}", f"run.output_dir={tmp_path}"])
    with phases.observed(around):
        result = train(config, load_kernel())
    per_step = ["rollout", "replay", "train", "sync"] if mode == "sync" else ["replay", "train", "sync"]
    # async: the collect runs on the controller's thread; its rollout_s is the wait. Around the steps: the
    # run's own phases (built, first publish; the final checkpoint and the export)
    assert seen == ["load", "first_sync", *per_step * 2, "checkpoint", "export"]
    steps = [m for m in result.history if m["step"] > 0]  # step 0: the eval before RL
    assert len(steps) == 2
    for metrics in steps:
        assert all(metrics[f"{p}_s"] >= 0 for p in ("rollout", "replay", "train", "sync"))
