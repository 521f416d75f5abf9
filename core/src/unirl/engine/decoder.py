"""How the embedded engine runs the model: a :class:`Decoder`, chosen once when the engine is built.

The engine's sampling loop (seeds, stops, abort, per-row finish times) is the same whatever computes
the logits; a decoder owns only the forward and its cache: ``prefill`` a left-padded batch, ``step``
one token per row, ``select`` the rows still going. Two implement it:

* :class:`~unirl.engine.fast_decoder.FastDecoder` (default, for Qwen3 / Qwen2 / Llama-shaped
  decoders): an incremental forward over the model's modules with a static KV cache;
* :class:`HFDecoder`: the model's own forward with a ``DynamicCache``, ``attention_mask`` and
  ``position_ids``; used for any other architecture (or with ``rollout.options.fast_path: false``).
  Under parity it is what the fast decoder is checked against (bit for bit, in the parity plugin's
  tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import torch


class Decoder(Protocol):
    """The forward of one batch's generation. ``state`` is the decoder's own (its cache, masks); the
    engine only passes it back."""

    #: rows with equal contexts may prefill once and fan out (:meth:`select` with repeated rows)
    shares_prefill: bool
    #: two batches' states may be joined mid-decode (``merge``, continuous batching: unirl.engine.merged)
    merges_rows: bool

    def prefill(self, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, max_new: int) -> dict[str, Any]:
        """Run the left-padded contexts ``ids [B, P]`` (``pos``: positions, ``valid [B, P + max_new]``: the
        non-pad columns, generated ones included). The state holds the last position's logits under
        ``"logits"``, which the engine pops."""
        ...

    def step(self, state: dict[str, Any], tok: torch.Tensor, pos: torch.Tensor, start: int) -> torch.Tensor:
        """Feed ``tok [B, 1]`` at positions ``pos [B, 1]`` (cache column ``start``); the next logits ``[B, V]``."""
        ...

    def select(self, state: dict[str, Any], keep: torch.Tensor) -> dict[str, Any]:
        """Keep (or repeat) the rows ``keep`` of ``state``."""
        ...


class HFDecoder:
    """The model's own forward, for any architecture transformers runs."""

    shares_prefill = False
    merges_rows = False  # a DynamicCache per batch: joining two would realign every layer's cache

    def __init__(self, model: Any) -> None:
        self.model = model

    def prefill(self, ids, pos, valid, max_new: int) -> dict[str, Any]:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        P = ids.shape[1]
        out = self.model(input_ids=ids, attention_mask=valid[:, :P].long(), position_ids=pos,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        return {"cache": out.past_key_values, "valid": valid, "logits": out.logits[:, -1]}

    def step(self, state, tok, pos, start: int):
        out = self.model(input_ids=tok, attention_mask=state["valid"][:, : start + 1].long(), position_ids=pos,
                         past_key_values=state["cache"], use_cache=True, logits_to_keep=1)
        state["cache"] = out.past_key_values
        return out.logits[:, -1]

    @staticmethod
    def select(state: dict[str, Any], keep: torch.Tensor) -> dict[str, Any]:
        state["valid"] = state["valid"][keep]
        state["cache"].batch_select_indices(keep)
        return state
