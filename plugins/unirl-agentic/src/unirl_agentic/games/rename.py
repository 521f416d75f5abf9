"""Warm-start traces with the game's names replaced by made-up words (``textworld.rename_demonstrations``).

Why: a tiny model fine-tuned on a few games' walkthroughs memorises them (train loss 0.064, held-out
commands invented words, 0 wins with 160 training games; docs/agentic.md, "Measured (issue 35)"). The
search demo showed the fix: when every trace names something never seen before, copying the name out of
the prompt is cheaper than memorising it. Generating thousands of games costs ~0.9 s each, so instead each
demonstration of a real game is rewritten with fresh names: "take shoe" from a list that offers "take shoe"
becomes "take vomu" from a list that offers "take vomu". The verbs, the objective's phrasing and the
game's answers stay real; only the words of the entities' names change, the same way in every turn.

Where the new words come from: mostly (``REAL_SHARE``) TextWorld's own name vocabulary (the nouns and
adjectives of its text grammars, ~350 words), so the names look like a held-out game's; the rest made up.
Measured: with made-up words only, the model learnt that names are consonant-vowel syllables and, on
held-out games, wrote such words instead of copying ``shoe`` (``drop fimimi``).
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

_KEEP = frozenset({"of", "a", "an", "the", "with", "from", "on", "in", "to"})
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
COMMANDS = "Commands: "
REAL_SHARE = 0.75


@lru_cache(maxsize=4096)
def entity_words(game: Path) -> tuple[str, ...]:
    """The words of every named entity of ``game`` (rooms, objects, containers), longest first, from the
    ``.json`` TextWorld writes beside the compiled game."""
    from textworld import Game

    words = {w.lower() for info in Game.load(str(game.with_suffix(".json"))).infos.values() if info.name
             for w in re.findall(r"[A-Za-z][A-Za-z'-]*", info.name) if w.lower() not in _KEEP}
    return tuple(sorted(words, key=lambda w: (-len(w), w)))


def grammar_files(pattern: str) -> list[Path]:
    """TextWorld's text grammars (``generator/data/text_grammars/<pattern>``), sorted."""
    import textworld

    return sorted((Path(os.path.dirname(textworld.__file__)) / "generator" / "data" / "text_grammars").glob(pattern))


@lru_cache(maxsize=1)
def textworld_words() -> tuple[str, ...]:
    """Every word TextWorld's house grammars can name a room or object with (``*_noun`` / ``*_adj`` rules)."""
    words: set[str] = set()
    for path in grammar_files("house_*.twg"):
        for line in path.read_text().splitlines():
            m = re.match(r"^([^#:\s][^:]*?_(?:noun|adj)[^:]*):(.*)$", line.strip())
            for item in (m.group(2).split(";") if m else ()):
                if "#" not in item:  # an expansion, not a word
                    words.update(w.lower() for w in re.findall(r"[A-Za-z][A-Za-z'-]+", item))
    return tuple(sorted(words - _KEEP))


def made_up_word(rng: random.Random) -> str:
    """A pronounceable word of 2-3 consonant-vowel syllables (``vomu``, ``kateri``): a byte-level model sees
    it as new letters, never as a word it knows."""
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3)))


def renaming(words: Iterable[str], rng: random.Random) -> dict[str, str]:
    """One fresh, distinct word per entity word: a TextWorld name word (``REAL_SHARE``) or a made-up one."""
    out: dict[str, str] = {}
    words = list(words)
    taken = set(words)
    pool = textworld_words()
    for w in words:
        pick = (lambda: rng.choice(pool)) if rng.random() < REAL_SHARE else (lambda: made_up_word(rng))
        new = pick()
        while new in taken:
            new = pick()
        out[w] = new
        taken.add(new)
    return out


def _case_like(original: str, new: str) -> str:
    if len(original) > 1 and original.isupper():
        return new.upper()
    return new[:1].upper() + new[1:] if original[:1].isupper() else new


def apply_renaming(text: str, mapping: dict[str, str]) -> str:
    """``text`` with every whole-word occurrence of a mapped word replaced (case kept: ``-= Cellar =-``
    becomes ``-= Vomu =-``), and each ``Commands:`` hint line sorted again as the game sorts it, so a
    command's place in the list says nothing the real game would not."""
    if not mapping:
        return text
    pattern = re.compile(r"\b(" + "|".join(re.escape(w) for w in sorted(mapping, key=len, reverse=True)) + r")\b",
                         re.IGNORECASE)
    out = pattern.sub(lambda m: _case_like(m.group(0), mapping[m.group(0).lower()]), text)
    lines = out.split("\n")
    for i, line in enumerate(lines):
        if line.startswith(COMMANDS):
            lines[i] = COMMANDS + " | ".join(sorted(line[len(COMMANDS):].split(" | ")))
    return "\n".join(lines)
