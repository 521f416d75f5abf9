"""The ``qwen2_5_vl`` model adapter: transformers' Qwen2.5-VL (images in, text out), built tiny from
scratch or loaded from a local dir (issue 71).

Why Qwen2.5-VL: transformers 5.19 (this venv) and vLLM 0.32 (``vllm/model_executor/models/qwen2_5_vl.py``)
both carry it. The tiny build keeps the language model's ``head_dim`` at 32 (vLLM's CPU attention
accepts 32, 64, ...) and ``mrope_section`` summing to ``head_dim / 2``; the vision tower is 2 blocks
of width 64 whose merger projects into the language model's width.

The processor is the model's own: transformers' ``Qwen2VLImageProcessor`` (its PIL backend: no
torchvision here) resizes and patches each image into ``pixel_values`` and ``image_grid_thw``; the
prompt's ``<|image_pad|>`` placeholder is expanded to one token per merged patch
(``grid.prod() // merge_size**2``), exactly what ``Qwen2_5_VLProcessor`` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from unirl.contracts import ModelAdapter

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.config import RunConfig

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
VISION_TOKENS: tuple[str, ...] = (VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)

#: ChatML with Qwen-VL's image placeholder: a message's content is a string, or a list of
#: ``{"type": "image"}`` / ``{"type": "text", "text": ...}`` items (the Qwen2.5-VL template's shape)
VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- else %}{{- item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: a ~0.5 M-parameter Qwen2.5-VL: text 128 wide, 2 layers, head_dim 32; vision 64 wide, 2 blocks
TINY_TEXT: dict[str, Any] = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                                 tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [4, 6, 6]})
TINY_VISION: dict[str, Any] = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                                   fullatt_block_indexes=[1], patch_size=14, spatial_merge_size=2,
                                   temporal_patch_size=2, window_size=56)
#: the image processor's pixel budget for the tiny build: 56x56 to 112x112 (4 to 16 image tokens)
TINY_PIXELS = dict(min_pixels=56 * 56, max_pixels=112 * 112)


class Qwen2_5_VLAdapter(ModelAdapter):
    name = "qwen2_5_vl"
    vision = True
    model_types = ("qwen2_5_vl",)
    #: parameter-name prefix of the vision tower (``actor.freeze: [vision]``)
    vision_prefix = "model.visual."

    def build_tokenizer(self, config: RunConfig) -> Any:
        """The ChatML demo tokenizer plus Qwen-VL's vision tokens and :data:`VL_CHAT_TEMPLATE`, or the
        tokenizer of ``model.tokenizer`` / ``model.path``."""
        from unirl.models.tokenizer import build_chat_demo_tokenizer, load_tokenizer

        if config.model.tokenizer:
            return load_tokenizer(config.model.tokenizer)
        if config.model.path and Path(config.model.path, "tokenizer.json").is_file():
            return load_tokenizer(config.model.path)
        tok = build_chat_demo_tokenizer()
        tok.add_tokens(list(VISION_TOKENS), special_tokens=True)
        tok.chat_template = VL_CHAT_TEMPLATE
        return tok

    def hf_config(self, config: RunConfig, tokenizer: Any = None, **overrides: Any):
        """``Qwen2_5_VLConfig``: ``model.path``'s, else the tiny build (``model.build`` keys go to the text
        model; ``vision_config`` to the tower) sized to the tokenizer and its vision token ids."""
        from transformers import AutoConfig, Qwen2_5_VLConfig

        if config.model.path:
            return AutoConfig.from_pretrained(str(config.model.path), **overrides)
        tok = tokenizer if tokenizer is not None else self.build_tokenizer(config)
        build = dict(config.model.build)
        vision = {**TINY_VISION, **build.pop("vision_config", {})}
        ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
            ("vision_start_token_id", VISION_START), ("image_token_id", IMAGE_PAD),
            ("vision_end_token_id", VISION_END), ("video_token_id", VIDEO_PAD))}
        text = {**TINY_TEXT, **build, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id,
                "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id}
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"],
                                **ids, **overrides)

    def build_keys(self, config: RunConfig) -> frozenset[str] | None:
        return None  # text and vision sub-configs: checked by transformers itself

    def build_model(self, config: RunConfig, tokenizer: Any = None) -> torch.nn.Module:
        """Load ``model.path`` when set, else build the tiny model from :meth:`hf_config` (seeded,
        :func:`unirl.models.seeded.seeded_build`)."""
        from transformers import Qwen2_5_VLForConditionalGeneration

        from unirl.models.seeded import seeded_build

        return seeded_build(config, Qwen2_5_VLForConditionalGeneration, lambda: self.hf_config(config, tokenizer))

    def engine_weight_name(self, name: str, engine: str) -> str:
        """The checkpoint name a server engine loads: transformers 5 holds ``model.language_model.*`` and
        ``model.visual.*`` in memory but ``save_pretrained`` writes (and vLLM's Qwen2.5-VL loads) the
        checkpoint format ``model.*`` / ``visual.*``. Only server engines call this (the embedded engine
        holds the actor's own modules and needs no renaming), so no engine is singled out by name."""
        for prefix, ckpt in (("model.language_model.", "model."), ("model.visual.", "visual.")):
            if name.startswith(prefix):
                return ckpt + name[len(prefix):]
        return name

    # ------------------------------------------------------------------ images
    def image_processor(self, config: RunConfig | None = None) -> Any:
        """transformers' Qwen2-VL image processor (PIL backend), at the tiny pixel budget unless
        ``model.path`` ships its own ``preprocessor_config.json``."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        if config is not None and config.model.path and Path(config.model.path, "preprocessor_config.json").is_file():
            return Qwen2VLImageProcessorPil.from_pretrained(str(config.model.path))
        return Qwen2VLImageProcessorPil(**TINY_PIXELS)

    @staticmethod
    def image_inputs(processor: Any, images: Any) -> dict[str, torch.Tensor]:
        """``{"pixel_values", "image_grid_thw"}`` of a prompt's images (:class:`unirl.multimodal.PromptImages`),
        computed once per prompt and shared by its samples."""
        def make(ims: tuple[Any, ...]) -> dict[str, Any]:
            out = processor(images=list(ims), return_tensors="pt")
            return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

        from unirl.multimodal import PROCESSED_KEY

        return images.processed(PROCESSED_KEY, make)  # one processor per run: the actor reads the same

    @staticmethod
    def expand_image_tokens(ids: list[int], grid_thw: Any, image_token_id: int, merge_size: int) -> list[int]:
        """``ids`` with the k-th ``<|image_pad|>`` repeated once per merged patch of image k
        (``grid_thw[k].prod() // merge_size**2``), as ``Qwen2_5_VLProcessor`` expands the text."""
        from unirl.kernel.errors import DataError

        counts = [int(g.prod()) // merge_size**2 for g in grid_thw]
        if ids.count(image_token_id) != len(counts):
            raise DataError(f"the prompt has {ids.count(image_token_id)} image placeholders for {len(counts)} "
                            "images; fix: one {'type': 'image'} item per image in the chat message")
        out: list[int] = []
        k = 0
        for t in ids:
            if t == image_token_id:
                out.extend([t] * counts[k])
                k += 1
            else:
                out.append(t)
        return out

    def prompt_ids(self, tokenizer: Any, processor: Any, messages: list[dict[str, Any]], images: Any) -> list[int]:
        """The token ids of a chat prompt with images: the chat template renders one placeholder per
        ``{"type": "image"}`` item, then each is expanded to its image's token count
        (:meth:`expand_image_tokens`); ``images`` is the prompt's :class:`~unirl.multimodal.PromptImages`."""
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        if images is None or not len(images):
            return ids
        grid = self.image_inputs(processor, images)["image_grid_thw"]
        return self.expand_image_tokens(ids, grid, tokenizer.convert_tokens_to_ids(IMAGE_PAD),
                                        processor.merge_size)
