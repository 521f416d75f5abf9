"""The forward inputs of a packed batch whose prompts carry images (issue 71): the pixels and the
3-D rotary positions of a Qwen-VL-style model (Qwen2-VL / Qwen2.5-VL M-RoPE).

Why here and not in :func:`unirl.packing.pack`: packing is model-free; these inputs need the model's
config (its image token id) and its own ``get_rope_index``. What the image processor made of each
prompt's images was computed once, when the prompt was rendered (:meth:`PromptImages.processed`, the
adapter's ``image_inputs``), and rides with the prompt, so the actor needs no processor.

Positions: a packed row holds several sequences, so ``position_ids`` is ``[4, 1, T]``: row 0 the
per-sequence text positions (restarting at 0; transformers builds the block-diagonal mask of the packed
row from them), rows 1-3 each sequence's M-RoPE (time, height, width), from ``get_rope_index`` over
that sequence alone, the same positions the engine's prefill and decode steps used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unirl.kernel.errors import SampleError
from unirl.multimodal import PROCESSED_KEY

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.packing import PackedBatch


def vision_inputs(model: Any, packed: PackedBatch) -> dict[str, torch.Tensor]:
    """``position_ids`` ``[4, 1, T]``, ``pixel_values`` and ``image_grid_thw`` for ``packed``'s forward."""
    import torch

    inner = model.model  # the VL model under the LM head: it owns get_rope_index
    image_token_id = model.config.image_token_id
    pixels, grids, rope = [], [], []
    cu = packed.cu_seqlens.tolist()
    dev = packed.input_ids.device
    for i, images in enumerate(packed.images or []):
        seq = packed.input_ids[:, cu[i]:cu[i + 1]]
        if images is None:
            rope.append(torch.arange(seq.shape[1], device=dev).view(1, 1, -1).expand(3, 1, -1))
            continue
        done = images.cache.get(PROCESSED_KEY)
        if done is None:
            raise SampleError(f"sequence {i} of the batch carries images the model's processor never saw; "
                              "fix: render image prompts through the adapter (prompt_ids / image_inputs)")
        pixels.append(done["pixel_values"])
        grids.append(done["image_grid_thw"])
        pos, _ = inner.get_rope_index(seq, mm_token_type_ids=(seq == image_token_id).int(),
                                      image_grid_thw=done["image_grid_thw"].to(dev))
        rope.append(pos)
    dtype = next(model.parameters()).dtype
    position_ids = torch.cat([packed.position_ids[None], torch.cat(rope, dim=-1).to(dev)], dim=0)
    return {"position_ids": position_ids, "pixel_values": torch.cat(pixels).to(dev, dtype),
            "image_grid_thw": torch.cat(grids).to(dev)}
