"""What an engine needs to sample one model turn, built from ``rollout.*``: one contract every
engine reads, so the trainer states it once."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from unirl.kernel.errors import ConfigError
from unirl.samples import Sample

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import RunConfig


@dataclass(frozen=True)
class SamplingParams:
    """What an engine needs to sample one model turn; built from ``rollout.*`` by the trainer.

    ``max_new_tokens`` caps one turn. ``max_response_tokens`` (None: no cap) caps the whole response of
    a trajectory, observations included, so an agentic loop cannot grow without bound: a continuation
    generates at most :meth:`new_token_limit` tokens. ``stop`` strings end a turn like stop token ids.
    ``ignore_eos`` keeps generating past the eos token (the model's and the tokenizer's; explicit
    ``stop_token_ids`` other than eos and ``stop`` strings still end a turn), so a fixed-length
    benchmark is possible on every engine; ``min_new_tokens`` suppresses eos and the stop token ids
    (never the stop strings: no engine can un-write text) until that many tokens of the turn exist.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    max_response_tokens: int | None = None
    logprobs: bool = True  # return the sampled tokens' fp32 log-probs
    ignore_eos: bool = False
    min_new_tokens: int = 0

    @classmethod
    def from_config(cls, config: RunConfig, stop_token_ids: Iterable[int] = (), **changes: Any) -> SamplingParams:
        r = config.rollout
        base = dict(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                    top_k=r.top_k, stop_token_ids=tuple(stop_token_ids), stop=tuple(r.stop),
                    max_response_tokens=r.max_response_tokens, ignore_eos=r.ignore_eos,
                    min_new_tokens=r.min_new_tokens)
        base.update(changes)
        return cls(**base)

    def new_token_limit(self, sample: Sample) -> int:
        """Tokens the next turn of ``sample`` may generate (0: its budget is spent)."""
        if self.max_response_tokens is None:
            return self.max_new_tokens
        return max(0, min(self.max_new_tokens, self.max_response_tokens - len(sample.response_ids)))


def stop_token_ids(config: RunConfig, tokenizer: Any) -> list[int]:
    """eos, the chat template's end-of-turn token under ``data.chat_template``, plus every ``rollout.stop``
    string that is one token: what :meth:`SamplingParams.from_config`
    takes as ``stop_token_ids``. Longer strings end a turn as text: they reach the engine as
    ``SamplingParams.stop`` (``from_config`` passes all of them)."""

    ids = [tokenizer.eos_token_id]
    if config.data.chat_template:  # a chat turn ends with the template's end-of-turn token (<|im_end|> ...)
        from unirl.data.chat import end_of_turn_id

        eot = end_of_turn_id(tokenizer)
        if eot is not None and eot not in ids:
            ids.append(eot)
    for i, text in enumerate(config.rollout.stop):
        enc = tokenizer.encode(text, add_special_tokens=False)
        if not enc:
            raise ConfigError(f"rollout.stop[{i}]: {text!r} encodes to no tokens; fix: remove it or give text")
        if len(enc) == 1:
            ids.append(enc[0])
    return ids
