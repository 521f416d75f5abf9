"""The embedded engine's decoder for a vision-language model (an adapter with ``vision = True``).

Why its own decoder: a Qwen-VL forward takes the prompt's ``pixel_values`` / ``image_grid_thw`` at
prefill, and its rotary positions are 3-D (M-RoPE): image tokens get (time, row, column) positions and
the text after an image continues from ``max + 1``, not from its token index. The HF forward keeps that
offset (``rope_deltas``) as state on the module, which does not survive the engine dropping finished
rows; here it is computed once per batch with the model's own ``get_rope_index`` and carried in the
decoder's state, row by row. A decode step's position is then ``context length + t + delta`` on all
three axes (what transformers' own generation computes).

Rows of one batch may mix image and text prompts; each image-bearing row's images are concatenated in
row order, which is the order the model scatters image features into placeholder tokens. No shared
prefill (``shares_prefill = False``): sharing would need the image features fanned out too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unirl.engine.decoder import HFDecoder

if TYPE_CHECKING:  # pragma: no cover
    import torch


class VLDecoder(HFDecoder):
    """The model's own forward, with images at prefill and M-RoPE positions carried per row: a decode step
    is :class:`HFDecoder`'s with each row's 3-D position offset (its ``deltas``) added."""

    def __init__(self, model: Any, adapter: Any, processor: Any) -> None:
        super().__init__(model)
        self.adapter = adapter
        self.processor = processor
        self.image_token_id = model.config.image_token_id
        c = model.config
        #: the placeholder ids the processor alone writes (the engine never draws them)
        self.placeholder_ids = sorted({c.image_token_id, c.video_token_id, c.vision_start_token_id,
                                       c.vision_end_token_id})

    def image_kwargs(self, images: list[Any]) -> dict[str, torch.Tensor]:
        """``pixel_values`` and ``image_grid_thw`` of the rows' images (rows without images add none)."""
        import torch

        per_row = [self.adapter.image_inputs(self.processor, im) for im in images if im is not None]
        if not per_row:
            return {}
        dtype = next(self.model.parameters()).dtype
        return {"pixel_values": torch.cat([r["pixel_values"] for r in per_row]).to(dtype),
                "image_grid_thw": torch.cat([r["image_grid_thw"] for r in per_row])}

    def prefill(self, ids, pos, valid, max_new: int, images: list[Any] | None = None) -> dict[str, Any]:
        import torch
        from transformers import DynamicCache

        P = ids.shape[1]
        mask = valid[:, :P].long()
        kw = self.image_kwargs(images or [])
        if kw:
            pos3, deltas = self.model.model.get_rope_index(
                ids, mm_token_type_ids=(ids == self.image_token_id).int(), image_grid_thw=kw["image_grid_thw"],
                attention_mask=mask)
        else:
            pos3, deltas = pos[None].expand(3, -1, -1), torch.zeros((ids.shape[0], 1), dtype=torch.long)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos3,
                         past_key_values=DynamicCache(config=self.model.config), use_cache=True,
                         logits_to_keep=1, **kw)
        return {"cache": out.past_key_values, "valid": valid, "deltas": deltas.to(ids.device),
                "logits": out.logits[:, -1]}

    def step(self, state, tok, pos, start: int):
        return super().step(state, tok, (pos + state["deltas"])[None].expand(3, -1, -1), start)

    @staticmethod
    def select(state: dict[str, Any], keep: torch.Tensor) -> dict[str, Any]:
        state["deltas"] = state["deltas"][keep]
        return HFDecoder.select(state, keep)
