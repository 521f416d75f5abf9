"""The built-in synthetic arithmetic task: ``"Q: 12+7=? A:"`` -> ``19``.

Small enough for the tiny char-level model to learn on 2 CPU cores, with a held-out split that shares
no problem with training. Every problem is a triple ``(a, op, b)`` with operands in
``0..max_operand`` and ``op`` from ``ops``. The triples are shuffled once with ``seed``; the first
``n_eval`` become the eval split (distinct problems), the rest form the training pool, which is cycled
(reshuffled) to make ``n_train`` rows. So the splits are disjoint by construction, and the eval split
depends only on (seed, ops, max_operand, n_eval), never on ``n_train``.
"""

from __future__ import annotations

import random
from typing import Any, Literal

from unirl.config import ArithSection
from unirl.kernel.errors import DataError

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

Triple = tuple[int, str, int]


def arith_prompt(a: int, op: str, b: int) -> str:
    return f"Q: {a}{op}{b}=? A:"


def arith_triples(section: ArithSection) -> tuple[list[Triple], list[Triple]]:
    """(train pool, eval problems): disjoint lists of distinct ``(a, op, b)`` triples."""
    ops = list(dict.fromkeys(section.ops))  # dedupe, keep order
    if not ops:
        raise DataError("data.arith.ops is empty: list at least one of '+', '-', '*'")
    if section.max_operand < 0:
        raise DataError(f"data.arith.max_operand must be >= 0, got {section.max_operand}")
    n = section.max_operand + 1
    triples = [(a, op, b) for op in ops for a in range(n) for b in range(n)]
    if section.n_eval < 0 or section.n_train < 0:
        raise DataError("data.arith.n_train and data.arith.n_eval must be >= 0")
    if section.n_eval >= len(triples):
        raise DataError(
            f"data.arith.n_eval={section.n_eval} leaves no training problems: there are only "
            f"{len(triples)} distinct problems with max_operand={section.max_operand} and ops={ops} "
            "(fix: lower data.arith.n_eval or raise data.arith.max_operand)"
        )
    random.Random(section.seed).shuffle(triples)
    return triples[section.n_eval :], triples[: section.n_eval]


def arith_rows(section: ArithSection, split: Literal["train", "eval"]) -> list[dict[str, Any]]:
    """Rows ``{"prompt": "Q: 12+7=? A:", "answer": 19}`` for ``split``, deterministic from ``seed``.

    Train has ``n_train`` rows (problems repeat when the pool is smaller than ``n_train``, each as
    evenly as possible); eval has ``n_eval`` distinct problems, none of which appears in train.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    pool, held_out = arith_triples(section)
    if split == "eval":
        chosen = held_out
    else:
        rng = random.Random(section.seed + 1)
        chosen = []
        while len(chosen) < section.n_train:
            epoch = list(pool)
            rng.shuffle(epoch)
            chosen.extend(epoch[: section.n_train - len(chosen)])
    return [{"prompt": arith_prompt(a, op, b), "answer": _OPS[op](a, b)} for a, op, b in chosen]
