"""The prompt form vLLM 0.32 takes for images (issue 71), without vLLM: one ``<|image_pad|>`` per image.

vLLM expands each image's placeholder itself, so the host collapses the adapter's expanded prompt
(``unirl_vllm.multimodal.placeholder_prompt``). Oracle: the adapter's own expansion (the one
``Qwen2_5_VLProcessor`` does) of the collapsed prompt gives back the prompt the trainer holds, for prompts
with several images of different sizes. The end-to-end check against vLLM's forward is
``test_vllm_vlm.py``.
"""

from __future__ import annotations

import pytest


def _prompt(n_images: int, sizes: list[int]):
    from PIL import Image

    from unirl.api import PromptImages, RunConfig
    from unirl.models.qwen2_5_vl import IMAGE_PAD, Qwen2_5_VLAdapter

    adapter = Qwen2_5_VLAdapter()
    config = RunConfig.model_validate({"model": {"adapter": "qwen2_5_vl"}})
    tok, proc = adapter.build_tokenizer(config), adapter.image_processor(config)
    images = PromptImages(tuple(Image.new("RGB", (s, s), (200, 10 * i, 0)) for i, s in enumerate(sizes)))
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": "How many?"}]
    ids = adapter.prompt_ids(tok, proc, [{"role": "user", "content": content}], images)
    grid = adapter.image_inputs(proc, images)["image_grid_thw"]
    return adapter, ids, grid, tok.convert_tokens_to_ids(IMAGE_PAD), proc.merge_size


@pytest.mark.parametrize("sizes", [[112], [56, 112], [84, 56, 112]])
def test_collapsed_prompt_expands_back_to_the_trainers_prompt(sizes):
    from unirl_vllm.multimodal import placeholder_prompt

    adapter, ids, grid, pad, merge = _prompt(len(sizes), sizes)
    collapsed = placeholder_prompt(ids, pad)
    assert collapsed.count(pad) == len(sizes)  # one placeholder per image, as the chat template renders it
    assert len(ids) - len(collapsed) == sum(int(g.prod()) // merge**2 - 1 for g in grid)
    assert adapter.expand_image_tokens(collapsed, grid, pad, merge) == ids
    assert placeholder_prompt(collapsed, pad) == collapsed  # already collapsed: unchanged


def test_prompt_length_mismatch_is_one_line_naming_the_fix():
    from unirl.api import UniRLError
    from unirl_vllm.multimodal import check_prompt_len

    check_prompt_len("p0", 49, 49)
    check_prompt_len("p0", 49, None)
    with pytest.raises(UniRLError) as info:
        check_prompt_len("p0", 49, 64)
    msg = str(info.value)
    assert "\n" not in msg and "p0" in msg and "64" in msg and "49" in msg and "fix:" in msg
