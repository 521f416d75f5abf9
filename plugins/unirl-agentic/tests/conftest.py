"""Shared fixtures: the byte-level demo tokenizer and a real embedded TorchEngine on a tiny Qwen3."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # importlib mode: make agentic_support importable by name
    sys.path.insert(0, str(_HERE))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM reads its environment at import (test_vllm.py)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_HERE.parents[2] / ".cache" / "inductor"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def tok():
    from unirl.api import build_demo_tokenizer

    return build_demo_tokenizer()


@pytest.fixture(scope="session")
def engine(tok):

    from unirl.api import Qwen3Adapter, RunConfig, build_engine

    eng = build_engine(RunConfig(), adapter=Qwen3Adapter(), tokenizer=tok)
    yield eng
    eng.close()
