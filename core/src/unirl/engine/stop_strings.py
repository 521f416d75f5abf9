"""Stop strings of the embedded engine: which rows a new token ended, without decoding every row.

A row ends when its decoded turn text contains a ``sampling.stop`` string. Decoding every row at every
step would cost a tokenizer call per row per step, so strings are checked only on rows whose new token
can end one (its lone decode contains the last character of a stop string, is a partial UTF-8 byte,
or decodes to nothing): a vectorised lookup per step, then a decode of the row's tail for those rows
only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch


class StopStrings:
    """The stop-string check of one engine: its tokenizer's vocabulary text and, per set of stop
    strings, the ``[V]`` mask of tokens that can complete one (both made once, then cached)."""

    def __init__(self, tokenizer: Any, model_config: Any, device: Any) -> None:
        self.tokenizer, self.model_config, self.device = tokenizer, model_config, device
        self._vocab_text: list[str] | None = None
        self._candidates: dict[tuple[str, ...], torch.Tensor] = {}

    def candidates(self, stops: tuple[str, ...]) -> torch.Tensor:
        """``[V]`` bool: tokens that can complete one of ``stops`` (see the module doc). Cached."""
        import torch

        mask = self._candidates.get(stops)
        if mask is not None:
            return mask
        vocab = int(self.model_config.vocab_size)
        if self._vocab_text is None:
            n = min(vocab, len(self.tokenizer))
            self._vocab_text = self.tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=True)
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        lasts = {s[-1] for s in stops if s}
        flags = [i not in special and (not t or "\ufffd" in t or any(c in t for c in lasts))
                 for i, t in enumerate(self._vocab_text)]
        flags += [False] * (vocab - len(flags))  # ids past the tokenizer decode to nothing
        mask = torch.tensor(flags[:vocab], dtype=torch.bool, device=self.device)
        self._candidates[stops] = mask
        return mask

    def match(self, stops: tuple[str, ...], cand: torch.Tensor, tok: torch.Tensor, stopped: torch.Tensor,
              done: torch.Tensor, rows: torch.Tensor, out_tok: torch.Tensor, t: int) -> None:
        """Set ``stopped`` (in place) for the live rows whose turn text now contains one of ``stops``.
        Only rows whose new token can end a stop string (``cand``) are decoded, and only their tail."""
        tail = 4 * max(len(x) for x in stops) + 4  # tokens decoded for a stop-string check
        for j in (cand[tok] & ~done & ~stopped).nonzero()[:, 0].tolist():
            r = int(rows[j])
            text = self.tokenizer.decode(out_tok[r, max(0, t + 1 - tail) : t + 1].tolist(), skip_special_tokens=True)
            if any(x in text for x in stops):
                stopped[j] = True
