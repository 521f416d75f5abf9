"""Turning a judge's free-text output into a score, by the rule in ``reward.judge.verdict``.

Why negative forms first: every negative verdict contains a positive word ("not correct", "incorrect",
"isn't right"), so a rule that looked for "correct" first would reward the policy for the judge's
rejections. Any negative match scores 0, whatever else the text says; only then does a positive
match score 1. Double negations ("not incorrect") therefore score 0: the rule errs towards a miss,
never towards a false reward. Text is normalised first (NFKC, format characters such as zero-width
spaces and soft hyphens dropped, typographic apostrophes folded, lower case, whitespace collapsed), so
``In\u00adcorrect`` or ``isn\u2019t correct`` cannot slip past the patterns.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from unirl.config import VerdictSection

_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'", "`": "'", "\u00b4": "'"})
_SPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """What the patterns see: NFKC, no format characters (Cf), plain apostrophes, lower case, single spaces."""
    text = unicodedata.normalize("NFKC", text)
    text = "".join(ch for ch in text if unicodedata.category(ch) != "Cf").translate(_APOSTROPHES)
    return _SPACE.sub(" ", text.lower()).strip()


@dataclass(frozen=True)
class VerdictRule:
    """A compiled :class:`~unirl.config.VerdictSection`: ``parse(text)`` is 0.0, 1.0 or None (unparsed)."""

    negative: tuple[re.Pattern[str], ...]
    positive: tuple[re.Pattern[str], ...]
    scope: str = "all"

    @classmethod
    def from_section(cls, section: VerdictSection) -> VerdictRule:
        return cls(negative=tuple(re.compile(p, re.IGNORECASE) for p in section.negative),
                   positive=tuple(re.compile(p, re.IGNORECASE) for p in section.positive),
                   scope=section.scope)

    def parse(self, text: str) -> float | None:
        if self.scope == "first_line":
            text = next((line for line in text.splitlines() if line.strip()), "")
        norm = normalize(text)
        if any(p.search(norm) for p in self.negative):
            return 0.0
        if any(p.search(norm) for p in self.positive):
            return 1.0
        return None


def parse_verdict(text: str, section: VerdictSection | None = None) -> float | None:
    """Parse one judge output with ``section``'s rule (the default rule when None)."""
    return VerdictRule.from_section(section or VerdictSection()).parse(text)
