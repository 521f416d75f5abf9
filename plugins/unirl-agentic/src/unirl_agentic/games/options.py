"""``plugins.agentic.textworld``: which games, how an episode is capped and rewarded."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from unirl.api import StrictOptions


class TextWorldOptions(StrictOptions):
    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, ge=0, le=2**62, description="game i of a split is generated with a seed derived from this one")
    n_train: int = Field(16, ge=1, le=2000, description="training games")
    n_eval: int = Field(8, ge=1, le=2000, description="held-out games (other seeds)")
    world_size: int = Field(1, ge=1, le=10, description="rooms (tw-make custom --world-size)")
    nb_objects: int = Field(2, ge=1, le=30, description="objects (tw-make custom --nb-objects)")
    quest_length: int = Field(1, ge=1, le=10, description="walkthrough length (tw-make custom --quest-length)")
    max_steps: int = Field(3, ge=1, le=200, description="episode cap: game commands per trajectory")
    win_bonus: float = Field(1.0, ge=0.0, description="added to the score on a win (rewards: score delta + this)")
    admissible_hint: bool = Field(True, description="list the admissible commands after each observation")
    observation: Literal["compact", "full"] = Field(
        "compact", description="full: the game's text as printed; compact: without the banner, the status line "
        "and blank lines (a byte-level model pays per character)")
    rename_demonstrations: bool = Field(
        False, description="warm-start traces name the game's entities with other words (mostly TextWorld's own "
        "vocabulary, some made up), fresh per trace, so "
        "a tiny model learns to copy the command from the prompt instead of memorising the few training games")
    word_tokenizer: bool = Field(
        False, description="`unirl agentic-data` also writes a tokenizer whose tokens are TextWorld's words "
        "(games/tokenizer.py) to model.tokenizer: a prompt is ~3.5x fewer tokens than bytes, and a listed "
        "command is a few tokens to copy")
    cache_dir: str = Field(".cache/textworld", description="where generated games are written (and reused)")
