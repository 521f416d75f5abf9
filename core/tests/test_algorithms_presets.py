"""Every paper preset in recipes/ runs (3 tiny steps), and the demo learns with GSPO and with DAPO."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from unirl.config import load_config
from unirl.kernel import load_kernel
from unirl.trainer.loop import train

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ("grpo-deepseekmath", "dr-grpo", "dapo", "gspo", "ppo-gae")
TINY = [
    "sft.steps=10", "sft.batch_size=16", "trainer.steps=3", "trainer.prompts_per_step=4", "trainer.eval_every=0",
    "trainer.eval_k=1", "trainer.progress=false", "trainer.plot=false", "data.arith.n_train=64",
    "data.arith.n_eval=4", "rollout.n=4", "model.build={hidden_size: 32, intermediate_size: 64}",
]


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_runs_three_steps(tmp_path, preset):
    extra = ["rollout.n=1"] if preset == "ppo-gae" else []
    config = load_config(ROOT / "recipes" / f"{preset}.yaml", [*TINY, *extra, f"run.output_dir={tmp_path}"])
    result = train(config, load_kernel())
    assert result.steps_done == 3 and len([h for h in result.history if h["step"] > 0]) == 3
    last = result.history[-1]
    assert math.isfinite(last["loss"]) and math.isfinite(last["reward"])
    if preset == "dapo":
        assert {"ds_draws", "ds_batch_groups", "overlong_frac"} <= set(last)
        assert 1 <= last["ds_draws"] <= config.algorithm.dynamic_sampling.max_draws
    if preset == "grpo-deepseekmath":
        assert "kl" in last
    if preset == "ppo-gae":
        assert "vf_loss" in last


def learns(tmp_path, preset: str) -> float:
    config = load_config(ROOT / "recipes" / f"{preset}.yaml", [f"run.output_dir={tmp_path}", "trainer.progress=false",
                                                               "trainer.plot=false", "trainer.eval_every=0"])
    t0 = time.perf_counter()
    result = train(config, load_kernel())
    gain = result.eval_after - result.eval_before
    print(f"{preset}: avg@4 {result.eval_before:.3f} -> {result.eval_after:.3f} (gain {gain:+.3f}) "
          f"in {time.perf_counter() - t0:.0f} s")
    return gain


@pytest.mark.slow
@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
def test_demo_learns_with_gspo(tmp_path):
    assert learns(tmp_path, "gspo") >= 0.15


@pytest.mark.slow
@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
def test_demo_learns_with_dapo(tmp_path):
    assert learns(tmp_path, "dapo") >= 0.15
