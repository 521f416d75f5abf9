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



def _text_batch_positions(_module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A text-only packed batch's ``[1, T]`` positions as ``[4, 1, T]`` (see :func:`install_actor_hooks`)."""
    pos = kwargs.get("position_ids")
    if pos is None or pos.ndim != 2:
        return None
    return args, {**kwargs, "position_ids": pos[None].expand(4, *pos.shape)}


def install_actor_hooks(model: Any, *, sharded: bool) -> list[Any]:
    """The forward hooks an actor's vision-language model needs (the actor calls it when its adapter
    declares ``vision``); returns the handles.

    * Always: a text-only packed batch gets ``[4, 1, T]`` positions, text positions in every row. Why: with
      ``[1, T]`` the Qwen-VL model has no text-position row, so transformers cannot see where each packed
      sequence starts and a later sequence attends to the earlier ones (a text row's log-prob moved by 0.13
      when packed after another on the tiny model). A text row's M-RoPE positions are its text positions.
    * ``sharded`` (FSDP): :func:`tower_every_forward`."""
    handles = [model.model.register_forward_pre_hook(_text_batch_positions, with_kwargs=True)]
    if sharded:
        handles += tower_every_forward(model)
    return handles


def tower_every_forward(model: Any) -> list[Any]:
    """Make every forward of ``model`` (a Qwen-VL-style model) run its vision tower, on one dummy image
    (a ``merge x merge`` patch grid, one image token's worth) when the batch carries no pixels, and add
    ``0 *`` its output to the language model's input embeddings. Returns the hook handles.

    Why: a sharded actor (FSDP) all-gathers each vision block's parameters in that block's forward and
    reduce-scatters its gradients in its backward. Collectives pair by order, so a rank whose micro-batch
    has no image (a text row, or the padding micro-batch of a rank with fewer samples) must still run the
    tower, or its next all-gather pairs with another rank's vision block: the wrong weights, silently (a
    text row's log-prob moved by 0.13 on the tiny model), or a dead rank. Adding an exact zero leaves the
    numbers as they are and gives the tower zero gradients on that rank. The hooks run inside the model's
    own forward, where the root's parameters (the patch embedding, the merger) are gathered."""
    import torch

    inner = model.model
    state: dict[str, bool] = {"images": False}

    def seen(_module: Any, args: tuple, kwargs: dict) -> None:
        state["images"] = kwargs.get("pixel_values") is not None

    def dummy(_module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        embeds = kwargs.get("inputs_embeds")
        if state["images"] or embeds is None:
            return None
        vc = inner.visual.config
        m = vc.spatial_merge_size
        grid = torch.tensor([[1, m, m]], device=embeds.device)
        pixels = torch.zeros(m * m, vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2,
                             device=embeds.device, dtype=inner.visual.dtype)
        out = inner.visual(pixels, grid_thw=grid).pooler_output
        return args, {**kwargs, "inputs_embeds": embeds + 0.0 * out.sum().to(embeds.dtype)}

    return [inner.register_forward_pre_hook(seen, with_kwargs=True),
            inner.language_model.register_forward_pre_hook(dummy, with_kwargs=True)]
