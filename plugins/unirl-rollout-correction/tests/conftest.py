"""Test set-up: the support modules importable by name (``rc_support``, ``rc_reference`` and the FSDP
plugin's ``fsdp_support``), and vLLM's environment before vLLM is imported."""

from __future__ import annotations

import os
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parents[2]
for p in (str(_HERE), str(_ROOT / "plugins" / "unirl-fsdp" / "tests")):
    if p not in sys.path:  # pytest's importlib mode does not put test directories on sys.path
        sys.path.insert(0, p)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_ROOT / ".cache" / "inductor"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
