"""Model facts for the plan, from the adapter's ``architecture`` (``model.path``'s config.json as read, or
the ``model.build`` a run would construct): plain numbers, never a module, a weight or a transformers
config object.

Why plain data: the plan reads a dozen integers. Building a transformers config object imports
transformers and torch (about 2.5 s of CPU here, most of what ``unirl plan`` took); ``unirl plan`` is
meant to answer in under 2 s on a laptop before anything heavy is installed or started.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unirl.config import RunConfig
from unirl.memory_plan.layout import ModelFacts


def facts_of(arch: Mapping[str, Any]) -> ModelFacts:
    """The :class:`ModelFacts` of a config's fields (config.json's keys; a multimodal config's
    ``text_config`` is the decoder). Absent fields take transformers' own fallbacks: ``head_dim`` is
    hidden / heads, ``num_key_value_heads`` is the head count (no GQA)."""
    text = arch.get("text_config") or arch
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
    return ModelFacts(
        vocab=int(text["vocab_size"]), hidden=hidden, layers=int(text["num_hidden_layers"]),
        intermediate=int(text.get("intermediate_size") or 0), heads=heads,
        kv_heads=int(text.get("num_key_value_heads") or heads), head_dim=head_dim,
        tied=bool(arch.get("tie_word_embeddings", False)), experts=experts,
        moe_intermediate=int(text.get("moe_intermediate_size") or 0))


def model_facts(config: RunConfig, adapter: Any) -> ModelFacts:
    """The facts of the model ``config`` builds or loads, through the adapter's ``architecture``."""
    return facts_of(adapter.architecture(config))
