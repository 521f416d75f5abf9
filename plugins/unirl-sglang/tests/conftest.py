"""Test set-up: one tiny Qwen3 checkpoint per session, stand-in SGLang servers on loopback.

The model is built at test time (nothing is downloaded): the ``qwen3`` adapter's config, hidden 64,
two layers, with the demo tokenizer, saved to a temporary directory. SGLang itself cannot run here
(CUDA-only kernels); :mod:`sglang_standin` serves SGLang's HTTP API on core's real torch engine.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # sglang_standin
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
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
    Qwen3ForCausalLM(hf).to(torch.float32).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def standin(tiny_model_dir):
    from sglang_standin import StandIn

    server = StandIn(tiny_model_dir)
    yield server
    server.close()
