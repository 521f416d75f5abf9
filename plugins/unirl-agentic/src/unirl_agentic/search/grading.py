"""Answer grading for the search environment: exact match and token F1 (SQuAD's normalisation).

Registered as the rewards ``exact_match`` and ``f1``. Why both: exact match is the honest accuracy a
demo reports; F1 gives partial credit ("Tufi river" against "Tufi") when a denser reward helps."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from unirl.api import Sample

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def _gold(answer: Any) -> str:
    if answer is None or isinstance(answer, bool) or not str(answer).strip():
        raise ValueError(f"exact_match / f1: the gold answer {answer!r} must be a non-empty string")
    return str(answer)


def normalize(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    text = _ARTICLES.sub(" ", str(text).lower().translate(_PUNCT))
    return " ".join(text.split())


def _first_line(completion: str) -> str:
    lines = [ln for ln in completion.strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


def exact_match(completion: str, sample: Sample) -> float:
    """1.0 when the answer's first line equals the gold answer after :func:`normalize`."""
    return float(normalize(_first_line(completion)) == normalize(_gold(sample.answer)))


def f1(completion: str, sample: Sample) -> float:
    """Token F1 between the answer's first line and the gold answer (both normalised)."""
    pred, gold = normalize(_first_line(completion)).split(), normalize(_gold(sample.answer)).split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if not common:
        return 0.0
    p, r = common / len(pred), common / len(gold)
    return 2 * p * r / (p + r)


exact_match.parse_gold = _gold  # type: ignore[attr-defined]  # preflight reads every gold answer with it
f1.parse_gold = _gold  # type: ignore[attr-defined]
