"""A Llama adapter: how to build the model, which tokenizer, and how weight names map per engine."""

from __future__ import annotations

from typing import Any

from unirl.api import ModelAdapter


class LlamaAdapter(ModelAdapter):
    name = "example-llama"
    #: the parity provider for this family (``parity.py``), registered by the plugin when
    #: unirl-parity-vllm is installed; without it the adapter works as usual and parity is simply absent
    parity_adapter = "example-llama"

    def build_tokenizer(self, config) -> Any:
        from unirl.api import build_demo_tokenizer, load_tokenizer

        return load_tokenizer(config.model.tokenizer) if config.model.tokenizer else build_demo_tokenizer()

    def hf_config(self, config, tokenizer: Any = None, **overrides: Any):
        """The LlamaConfig of the model this run builds (or ``model.path``'s), without weights:
        preflight and engine plugins read head_dim, layer count and tied embeddings from it."""
        from transformers import AutoConfig, LlamaConfig

        if config.model.path:
            return AutoConfig.from_pretrained(str(config.model.path), **overrides)
        if "vocab_size" not in overrides:
            tok = tokenizer or self.build_tokenizer(config)
            overrides = {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id,
                         "eos_token_id": tok.eos_token_id, **overrides}
        arch = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)
        return LlamaConfig(**{**arch, **config.model.build, **overrides})

    def build_model(self, config, tokenizer: Any = None):
        import torch
        from transformers import AutoModelForCausalLM, LlamaForCausalLM

        if config.model.path:
            return AutoModelForCausalLM.from_pretrained(config.model.path)
        hf_config = self.hf_config(config, tokenizer)
        torch.manual_seed(config.run.seed)
        return LlamaForCausalLM(hf_config)

    def engine_weight_name(self, name: str, engine: str) -> str:
        return name  # HF names are what vLLM's Llama loader expects
