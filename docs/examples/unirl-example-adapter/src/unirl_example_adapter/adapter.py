"""A Llama adapter: how to build the model, which tokenizer, and how weight names map per engine."""

from __future__ import annotations

from typing import Any

from unirl.contracts import ModelAdapter


class LlamaAdapter(ModelAdapter):
    name = "example-llama"
    parity_adapter = None  # no bitwise-parity adapter for this family yet

    def build_tokenizer(self, config) -> Any:
        from unirl.models.tokenizer import build_demo_tokenizer, load_tokenizer

        return load_tokenizer(config.model.tokenizer) if config.model.tokenizer else build_demo_tokenizer()

    def build_model(self, config, tokenizer: Any = None):
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

        if config.model.path:
            return AutoModelForCausalLM.from_pretrained(config.model.path)
        tokenizer = tokenizer or self.build_tokenizer(config)
        arch = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)
        arch.update(config.model.build)
        torch.manual_seed(config.run.seed)
        return LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                            eos_token_id=tokenizer.eos_token_id, **arch))

    def engine_weight_name(self, name: str, engine: str) -> str:
        return name  # HF names are what vLLM's Llama loader expects
