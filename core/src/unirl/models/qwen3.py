"""The ``qwen3`` model adapter: transformers' Qwen3, built tiny from scratch or loaded from a local dir.

Tiny defaults keep ``head_dim`` at 32: vLLM's CPU attention backend accepts only head sizes
32, 64, 80, ... so the same model runs in the embedded engine and in vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from unirl.contracts import ModelAdapter, hf_config_keys

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
    #: the tiny default build and the transformers classes (names): a family subclass changes only these
    tiny: dict[str, Any] = TINY_QWEN3
    config_class, model_class = "Qwen3Config", "Qwen3ForCausalLM"
    #: loaded through AutoModelForCausalLM: the dense decoders the actor's packed attention and the
    #: engine's fast path are written for
    model_types = ("qwen3", "qwen2", "llama")

    def hf_config(self, config: RunConfig, tokenizer: Any = None, **overrides: Any):
        """The ``Qwen3Config`` of the model this run builds or loads (no weights).

        With ``model.path``: that directory's config. Otherwise ``TINY_QWEN3`` + ``model.build``, sized to
        ``tokenizer``'s vocabulary and special ids (the adapter's tokenizer when None). ``overrides``
        (e.g. ``vocab_size=``, ``pad_token_id=``) win over both and spare building a tokenizer."""
        import transformers
        from transformers import AutoConfig

        if config.model.path:
            return AutoConfig.from_pretrained(str(config.model.path), **overrides)
        if "vocab_size" not in overrides:
            tok = tokenizer if tokenizer is not None else self.build_tokenizer(config)
            bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
            overrides = {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id,
                         "eos_token_id": tok.eos_token_id, "bos_token_id": bos, **overrides}
        return getattr(transformers, self.config_class)(**{**self.tiny, **config.model.build, **overrides})

    def architecture(self, config: RunConfig) -> dict[str, Any]:
        """:meth:`hf_config`'s fields as plain data, without transformers: ``model.path``'s config.json as
        written, else ``tiny`` + ``model.build`` sized to the demo tokenizer (the memory plan's facts; a
        test holds both equal to :meth:`hf_config`'s). A ``model.tokenizer`` sizes the vocabulary by
        loading it, so that case takes :meth:`hf_config`'s route."""
        import json

        from unirl.models.tokenizer import demo_vocab_size

        if config.model.path:
            return json.loads(Path(config.model.path, "config.json").read_text())
        if config.model.tokenizer:
            return super().architecture(config)
        return {**self.tiny, **config.model.build, "vocab_size": demo_vocab_size()}

    def build_keys(self, config: RunConfig) -> frozenset[str]:
        """``config_class``'s constructor keywords plus the tiny default's keys: those include attributes
        the modeling code reads that are not constructor fields (Qwen3-MoE's ``head_dim``). Read from the
        class, so no tokenizer is built."""
        import transformers

        return hf_config_keys(getattr(transformers, self.config_class)) | frozenset(self.tiny)

    def build_model(self, config: RunConfig, tokenizer: Any = None) -> torch.nn.Module:
        """Load ``model.path`` when set, else build from :meth:`hf_config` (seeded, :func:`seeded_build`)."""
        import transformers
        from transformers import AutoModelForCausalLM

        from unirl.models.seeded import seeded_build

        cls = AutoModelForCausalLM if config.model.path else getattr(transformers, self.model_class)
        return seeded_build(config, cls, lambda: self.hf_config(config, tokenizer))

    def build_empty(self, config: RunConfig, tokenizer: Any = None) -> torch.nn.Module:
        """:meth:`build_model`'s model on the meta device: ``model.path``'s class from its config
        (``AutoModelForCausalLM.from_config``), else ``model_class`` of :meth:`hf_config`, in fp32."""
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        hf_config = self.hf_config(config, tokenizer)
        with torch.device("meta"):
            if config.model.path:
                model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
            else:
                model = getattr(transformers, self.model_class)(hf_config)
        model.config.use_cache = False
        return model.float()

    def build_tokenizer(self, config: RunConfig) -> Any:
        from unirl.models.tokenizer import build_demo_tokenizer, load_tokenizer

        if config.model.tokenizer:
            return load_tokenizer(config.model.tokenizer)
        if config.model.path and Path(config.model.path, "tokenizer.json").is_file():
            return load_tokenizer(config.model.path)
        return build_demo_tokenizer()
