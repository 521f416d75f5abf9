"""The model-family contract: how to build, tokenize and rename one family for each engine."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PretrainedConfig

    from unirl.config import RunConfig
    from unirl.routing import RouterSpec


#: keywords every transformers config constructor still converts (rope_* into ``rope_parameters``,
#: ``torch_dtype`` into ``dtype``, ``num_labels`` into the label maps) though they are not fields
_LEGACY_CONFIG_KEYS = frozenset({"rope_theta", "rope_scaling", "torch_dtype", "num_labels"})


def hf_config_keys(config_class: type) -> frozenset[str]:
    """The keywords a transformers config class takes: its constructor's named parameters (its own and
    its bases'), the aliases of its ``attribute_map``, and the legacy keywords it converts."""
    import inspect

    keys: set[str] = set(_LEGACY_CONFIG_KEYS)
    for cls in config_class.__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None:
            keys.update(name for name, p in inspect.signature(init).parameters.items()
                        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        keys.update(getattr(cls, "attribute_map", None) or {})
    return frozenset(keys)


class ModelAdapter(ABC):
    """How to build, tokenize and rename one model family. Third-party models ship one of these.

    The default ``qwen3`` adapter lives in :mod:`unirl.models.qwen3`.
    """

    name: str = ""
    parity_adapter: str | None = None  # name of the parity provider that applies, if any
    #: the HF ``model_type`` values of a ``model.path`` this adapter builds; preflight refuses any other
    #: before a model is loaded (empty: the adapter accepts any, and no check is made)
    model_types: tuple[str, ...] = ()
    #: the model takes images with its prompts (a vision-language family, :mod:`unirl.multimodal`): a data
    #: row with an image on an adapter without it is refused before any model is built
    vision: bool = False
    #: the parameter-name prefix of the vision tower (``actor.freeze: [vision]``); "" without one
    vision_prefix: str = ""

    @abstractmethod
    def build_model(self, config: RunConfig, tokenizer: Any = None) -> torch.nn.Module:
        """A transformers causal LM, from ``model.path`` or from scratch (``model.build``, sized to
        ``tokenizer``'s vocabulary). Same config + seed gives the same weights."""

    def build_empty(self, config: RunConfig, tokenizer: Any = None) -> torch.nn.Module | None:
        """:meth:`build_model`'s module tree with every tensor on the meta device (no memory, no values),
        or None when this adapter has no such build (the default).

        Why: a sharded actor (FSDP) builds this, shards it and fills only its own shards from
        ``model.path``, so no rank ever holds the whole model; with None every rank builds the whole
        model through :meth:`build_model` before sharding it, as before. The tree must be what
        :meth:`build_model` returns (class, parameter names, shapes), in fp32: an adapter whose
        :meth:`build_model` does more than construct the transformers model keeps the default."""
        return None

    @abstractmethod
    def build_tokenizer(self, config: RunConfig) -> Any:
        """A ``transformers.PreTrainedTokenizerFast`` (pad, eos set)."""

    @abstractmethod
    def hf_config(self, config: RunConfig) -> PretrainedConfig:
        """The transformers config of the model this run will build or load (no weights).

        Preflight and engine plugins read architecture facts from it (``head_dim``, layer count, tied
        embeddings) instead of special-casing adapter names."""

    def architecture(self, config: RunConfig) -> dict[str, Any]:
        """:meth:`hf_config`'s fields as plain data (config.json's keys), for readers that need numbers, not
        a config object: the memory plan (``unirl plan``), which must answer without importing
        transformers or torch. The default goes through :meth:`hf_config` (correct, seconds of imports);
        an adapter that can read them directly (config.json, its tiny defaults) overrides it."""
        return self.hf_config(config).to_dict()

    def build_keys(self, config: RunConfig) -> frozenset[str] | None:
        """The keys ``model.build`` may set, or None to accept any (no check).

        Why: a transformers config stores an unknown keyword as a plain attribute that no layer reads,
        so a misspelt key (``num_experts_total``) would build the default architecture silently;
        preflight checks ``model.build`` against this set, with a did-you-mean. The default reads the
        constructor of the config class :meth:`hf_config` returns (:func:`hf_config_keys`); an adapter
        whose builder accepts more (its own defaults, extra attributes its modeling code reads) adds them."""
        try:
            hf = self.hf_config(config)
        except Exception:  # noqa: BLE001 - a build that does not construct is reported by preflight itself
            return None
        return hf_config_keys(type(hf))

    def engine_weight_name(self, name: str, engine: str) -> str:
        """Map an actor parameter name to what ``engine`` expects (identity for HF-format engines)."""
        return name

    def engine_weights(self, name: str, tensor: torch.Tensor, engine: str) -> list[tuple[str, torch.Tensor]]:
        """One actor tensor as ``engine``'s checkpoint holds it: one renamed tensor by default
        (:meth:`engine_weight_name`); a family whose checkpoint splits a fused parameter (transformers 5
        keeps MoE experts fused in memory, per expert on disk) returns the pieces."""
        return [(self.engine_weight_name(name, engine), tensor)]

    def engine_args(self, engine: str, config: RunConfig) -> dict[str, Any]:
        """Extra engine constructor arguments this model needs (e.g. vLLM's ``max_model_len``)."""
        return {}

    def routers(self, model: torch.nn.Module) -> list[RouterSpec]:
        """The Mixture-of-Experts routers of ``model`` (built by this adapter), in layer order, for
        rollout routing replay (``algorithm.routing_replay``, :mod:`unirl.routing`); empty for a dense
        family, which is what makes R3 refuse it. An MoE family declares its routers here."""
        return []
