"""vLLM test set-up: environment first (vLLM reads it at import), then one tiny Qwen3 per session.

The model is built at test time (nothing is downloaded): the ``qwen3`` adapter's config with
``head_dim`` 32 (the smallest head size vLLM's CPU attention accepts) and the demo tokenizer, saved
to a temporary directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[3]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_ROOT / ".cache" / "inductor"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

IN_CI = os.environ.get("CI", "").lower() == "true"


@pytest.fixture(scope="session")
def require_vllm() -> None:
    """Skip without vLLM on a developer machine; in CI a missing vLLM is a failure, not a skip."""
    if IN_CI:
        import vllm  # noqa: F401 - ImportError fails the test
    else:
        pytest.importorskip("vllm")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 (hidden 64, 2 layers, head_dim 32, tied embeddings), fp32, with tokenizer."""
    import torch
    from transformers import Qwen3ForCausalLM

    from unirl.api import Qwen3Adapter, RunConfig, build_demo_tokenizer

    out = tmp_path_factory.mktemp("tiny_qwen3")
    tok = build_demo_tokenizer()
    config = RunConfig.model_validate({"model": {"build": {"hidden_size": 64, "intermediate_size": 128,
                                                           "num_attention_heads": 2, "num_key_value_heads": 1}}})
    hf = Qwen3Adapter().hf_config(config, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(hf).to(torch.float32)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out
