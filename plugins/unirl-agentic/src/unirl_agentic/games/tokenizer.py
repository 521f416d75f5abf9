"""``textworld.word_tokenizer``: TextWorld's words, for the tokenizer ``unirl agentic-data`` writes to
``model.tokenizer`` (``unirl.api.build_word_demo_tokenizer``).

Why: the demo tokenizer is byte-level, so a TextWorld prompt is ~350 tokens and the object a command names
sits hundreds of bytes back; a 2-layer model warm-started on it wrote plausible words, never the listed
object (docs/agentic.md, "Measured (issue 35)"). With one token per word the prompt is ~100 tokens and
playing a listed command is copying two or three tokens. The words come from TextWorld's own text grammars
(every template, room and object word its generator can write), not from any game, so held-out games are
tokenized as well as the training ones and nothing about them leaks into the vocabulary."""

from __future__ import annotations

import re
from functools import lru_cache

from unirl_agentic.games.rename import grammar_files

#: the commands' verbs and the words of the interpreter's own answers ("That's not a verb I recognise.")
_ENGINE_WORDS = ("commands inventory examine unlock lock take drop put insert open close eat look go north south "
                 "east west from with into on you can't see any such thing that's not a verb i recognise taken "
                 "dropped opened closed unlocked locked carrying nothing are what do want to")

#: large enough that every form of every grammar word is merged whole (the vocabulary stops at ~6,300)
WORD_VOCAB = 8192


@lru_cache(maxsize=1)
def grammar_words() -> tuple[str, ...]:
    """Every word of TextWorld's text grammars (``generator/data/text_grammars/*.twg``), lower case, plus
    the commands' verbs and the interpreter's stock answers."""
    words: set[str] = set(_ENGINE_WORDS.split())
    for path in grammar_files("*.twg"):
        for line in path.read_text().splitlines():
            if line.startswith("#"):
                continue
            text = re.sub(r"#[^#]*#|\([^)]*\)|\[[^\]]*\]", " ", line.partition(":")[2])  # tags, slots, markup
            words.update(w.lower() for w in re.findall(r"[A-Za-z][A-Za-z'-]*", text))
    return tuple(sorted(words))
