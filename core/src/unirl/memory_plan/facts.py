"""Model facts for the plan, from the adapter's ``hf_config`` (``model.path``'s config.json, or the
``model.build`` a run would construct): a transformers config object, never a module or a weight."""

from __future__ import annotations

from typing import Any

from unirl.config import RunConfig
from unirl.memory_plan.layout import ModelFacts


def facts_of(hf: Any) -> ModelFacts:
    """The :class:`ModelFacts` of a transformers config (dense or MoE decoder)."""
    text = getattr(hf, "text_config", None) or hf
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    experts = int(getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0) or 0)
    return ModelFacts(
        vocab=int(text.vocab_size), hidden=hidden, layers=int(text.num_hidden_layers),
        intermediate=int(getattr(text, "intermediate_size", 0) or 0), heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads), head_dim=head_dim,
        tied=bool(getattr(hf, "tie_word_embeddings", False)), experts=experts,
        moe_intermediate=int(getattr(text, "moe_intermediate_size", 0) or 0))


def model_facts(config: RunConfig, adapter: Any) -> ModelFacts:
    """The facts of the model ``config`` builds or loads, through the adapter's ``hf_config``."""
    return facts_of(adapter.hf_config(config))
