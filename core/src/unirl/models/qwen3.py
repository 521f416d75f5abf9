"""The ``qwen3`` model adapter: transformers' Qwen3, built tiny from scratch or loaded from a local dir.

Tiny defaults keep ``head_dim`` at 32: vLLM's CPU attention backend accepts only head sizes
32, 64, 80, ... so the same model runs in the embedded engine and in vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from unirl.contracts import ModelAdapter

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.config import RunConfig

#: A 3 M-parameter Qwen3: big enough to learn arithmetic formats, small enough for 2 CPU cores.
TINY_QWEN3: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


class Qwen3Adapter(ModelAdapter):
    name = "qwen3"
    parity_adapter = "qwen3"

    def hf_config(self, config: RunConfig, vocab_size: int, **special: int):
        from transformers import Qwen3Config

        kwargs = {**TINY_QWEN3, **config.model.build}
        return Qwen3Config(vocab_size=vocab_size, **special, **kwargs)

    def build_model(self, config: RunConfig, tokenizer: Any = None) -> torch.nn.Module:
        """Load ``model.path`` when set, else build from ``TINY_QWEN3`` + ``model.build`` (seeded)."""
        import torch
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, config.model.dtype)
        if config.model.path:
            model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=dtype)
        else:
            if tokenizer is None:
                tokenizer = self.build_tokenizer(config)
            special = dict(
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
            )
            hf_config = self.hf_config(config, vocab_size=len(tokenizer), **special)
            from transformers import Qwen3ForCausalLM

            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(config.run.seed)
                model = Qwen3ForCausalLM(hf_config)
            model = model.to(dtype)
        model.config.use_cache = False
        return model

    def build_tokenizer(self, config: RunConfig) -> Any:
        from unirl.models.tokenizer import build_demo_tokenizer, load_tokenizer

        if config.model.tokenizer:
            return load_tokenizer(config.model.tokenizer)
        if config.model.path and Path(config.model.path, "tokenizer.json").is_file():
            return load_tokenizer(config.model.path)
        return build_demo_tokenizer()
