"""Images on vLLM requests (issue 71): what the vLLM engine needs to serve a vision-language model.

* :func:`multi_modal_data`: a sample's prompt images (``unirl.api.images_of``) as vLLM's
  ``multi_modal_data`` (``{"image": [PIL, ...]}``). The images are PIL images, plain data, so a Ray
  replica gets them through the call as it gets token ids.
* :func:`placeholder_prompt`: the prompt ids as vLLM 0.32 takes them, one ``<|image_pad|>`` per image.
  Our prompt ids hold one per merged patch (the adapter expanded them, as ``Qwen2_5_VLProcessor`` does),
  but vLLM 0.32 always applies its own prompt update to a token prompt
  (``BaseMultiModalProcessor._apply_prompt_updates``: the first ``<|image_pad|>`` of each image becomes
  the image's N tokens); it does not detect an expanded prompt. Sent expanded, an image of N tokens became
  2N - 1 tokens: the image features on the first N, then N - 1 plain ``<|image_pad|>`` embeddings, and
  every later position shifted. That was the 0.06-0.18 log-prob gap on image rows (issue 71). vLLM's
  expansion of the collapsed prompt gives back our ids; :func:`check_prompt_len` holds it to that.
* :func:`placeholder_bias`: the placeholder ids are never drawn (a logit bias), as on the embedded engine.
* :func:`install_processor_shim`: vLLM 0.32's ``qwen2_vl.py`` (which ``qwen2_5_vl.py`` imports) imports
  ``smart_resize`` from transformers' torchvision image processor module. torchvision cannot be installed
  next to the CPU torch here (its PyPI builds are CUDA-linked), so that import fails and vLLM refuses the
  architecture ("failed to be inspected"). transformers' PIL processor module defines the same
  ``smart_resize`` (same source); the shim registers a module of that name exposing it, only when the
  real one cannot be imported, and checks the one symbol it provides. vLLM inspects a lazily registered
  architecture in a subprocess (which would not have the shim), so the shim also registers vLLM's own
  Qwen2.5-VL class as already imported. It holds in the process it ran in: the engine's in-process
  layout (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the default here); a multiprocess layout is not served.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from unirl.api import images_of

#: the module vLLM's Qwen2-VL family imports ``smart_resize`` from, and the PIL one that defines it too
_TV_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def install_processor_shim() -> bool:
    """Make ``_TV_MODULE`` importable without torchvision (see the module doc); True when the shim is in
    place, False when the real module imports (nothing to do)."""
    if _TV_MODULE in sys.modules:
        return bool(getattr(sys.modules[_TV_MODULE], "__unirl_shim__", False))
    try:
        importlib.import_module(_TV_MODULE)
        return False
    except ImportError as exc:
        if "torchvision" not in str(exc):
            raise
    pil = importlib.import_module(_PIL_MODULE)
    resize = getattr(pil, "smart_resize", None)
    if not callable(resize):  # a transformers release that moved it: fail naming the cause, not later
        raise ImportError(f"{_PIL_MODULE} has no smart_resize; the vLLM vision shim (unirl_vllm.multimodal) "
                          "needs updating for this transformers release, or install a CPU torchvision")
    shim = types.ModuleType(_TV_MODULE, "UniRL shim: smart_resize from the PIL image processor (no torchvision)")
    shim.smart_resize = resize  # type: ignore[attr-defined]
    shim.__unirl_shim__ = True  # type: ignore[attr-defined]
    sys.modules[_TV_MODULE] = shim
    _register_in_process()
    return True


def _register_in_process() -> None:
    """Register vLLM's Qwen2.5-VL class already imported (through the shim), so vLLM inspects it in this
    process: its lazy registry entry is inspected in a fresh ``python -m vllm...registry`` subprocess,
    which has no shim. The class registered is vLLM's own."""
    from vllm import ModelRegistry
    from vllm.model_executor.models import qwen2_5_vl

    qwen2_5_vl.Qwen2_5_VLProcessor = _image_only_processor(qwen2_5_vl.Qwen2_5_VLProcessor)
    # no video processor without torchvision: the model declares images as its only modality
    qwen2_5_vl.Qwen2_5_VLProcessingInfo.get_supported_mm_limits = _image_limits
    ModelRegistry.register_model("Qwen2_5_VLForConditionalGeneration", qwen2_5_vl.Qwen2_5_VLForConditionalGeneration)


def _image_limits(self: Any) -> dict[str, int | None]:
    return {"image": None}


def _image_only_processor(base: type) -> type:
    """``Qwen2_5_VLProcessor`` without its video processor: transformers' video processors (and their
    class mapping) need torchvision, so the processor vLLM builds for the model cannot be constructed.
    A subclass whose ``__init__`` names no ``video_processor`` has only the image processor and the
    tokenizer as sub-processors (``ProcessorMixin.get_attributes`` reads the signature); the image path
    is the base class's own code. Videos are refused by the engine (``limit_mm_per_prompt video: 0``)."""
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2_5_VLProcessor(base):  # type: ignore[misc, valid-type]
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
            self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            self.video_processor = None
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    ImageOnlyQwen2_5_VLProcessor.__name__ = ImageOnlyQwen2_5_VLProcessor.__qualname__ = base.__name__
    return ImageOnlyQwen2_5_VLProcessor


def multi_modal_data(sample: Any) -> dict[str, list[Any]] | None:
    """The sample's prompt images as vLLM's ``multi_modal_data``; None for a text prompt."""
    images = images_of(sample)
    if images is None or not len(images):
        return None
    return {"image": list(images.images)}


def image_token_of(hf_config: Any) -> int:
    """The image placeholder id vLLM expands (``hf_config.image_token_id``, the Qwen-VL family's field)."""
    from unirl.api import UniRLError

    tid = getattr(hf_config, "image_token_id", None)
    if tid is None:
        raise UniRLError(f"the model's config ({type(hf_config).__name__}) has no image_token_id, so the vLLM engine "
                         "cannot find the image placeholders; fix: a Qwen-VL-family checkpoint (config.json "
                         "image_token_id) or a text-only model.adapter")
    return int(tid)


#: the logit bias that keeps vLLM from drawing a placeholder id (vLLM clamps a bias to [-100, 100])
NEVER_BIAS = -100.0


def placeholder_bias(hf_config: Any) -> dict[int, float]:
    """``logit_bias`` for every request of a vision-language model: the placeholder ids only the processor
    writes (image, video, vision start and end) are never drawn, as on the embedded engine
    (``unirl.engine.vl_decoder``). A drawn ``<|image_pad|>`` would be an image token without pixels in the
    actor's replay. vLLM computes ``raw_logprobs`` before logits processors, so the log-probs keep the raw
    mass of these ids, as the replay does."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return {int(i): NEVER_BIAS for i in (getattr(hf_config, n, None) for n in names) if i is not None}


def placeholder_prompt(ids: list[int], image_token_id: int) -> list[int]:
    """``ids`` with each run of ``image_token_id`` collapsed to one token: the form vLLM 0.32 expands
    itself (see the module doc). A run is one image: the chat template wraps each image's placeholder in
    ``<|vision_start|>`` ... ``<|vision_end|>``, so two images never make one run."""
    out: list[int] = []
    for t in ids:
        if t != image_token_id or not out or out[-1] != image_token_id:
            out.append(t)
    return out


def check_prompt_len(sample_id: str, ours: int, vllm_len: int | None) -> None:
    """Raise when vLLM's expanded prompt is not as long as the sample's context: vLLM's image processor
    then made another number of image tokens than the adapter's (another pixel budget), and every
    log-prob after the image would be computed at shifted positions."""
    if vllm_len is not None and vllm_len != ours:
        from unirl.api import UniRLError

        raise UniRLError(f"vLLM expanded sample {sample_id}'s prompt to {vllm_len} tokens, the adapter to {ours}: "
                         "their image processors give different token counts per image; fix: give the "
                         "model directory the adapter's preprocessor_config.json (min_pixels/max_pixels)")


#: images one prompt may carry on vLLM (its start-up profiles this many images of the largest size);
#: ``rollout.options.engine_args.limit_mm_per_prompt`` overrides it
MAX_IMAGES_PER_PROMPT = 4


def image_engine_args() -> dict[str, Any]:
    """vLLM constructor arguments for a vision-language model.

    ``limit_mm_per_prompt``: images only (video needs torchvision's video processor, see
    :func:`install_processor_shim`). ``mm_device_do_normalize: False``: vLLM 0.32 would otherwise skip the
    processor's rescale/normalise and redo it on the device in a fused op (``FusedMMInputNorm``); the
    actor's replay feeds the processor's own normalised pixels, so the engine does the same, and its
    log-probs match a transformers forward of the same prompt."""
    return {"limit_mm_per_prompt": {"image": MAX_IMAGES_PER_PROMPT}, "mm_device_do_normalize": False}
