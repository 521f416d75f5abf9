"""Core's reward functions (registered as ``exact_int`` and ``math_verify``) and the scoring loop.

A reward function is ``fn(completion: str, sample: Sample) -> float``. It may raise: :func:`score`
marks that one sample failed (reward NaN, excluded from its group's statistics) and carries on. A
:class:`~unirl.contracts.BatchReward` (a judge, a reward model) is scored with one call per batch.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

from unirl.contracts import BatchReward
from unirl.samples import Sample

RewardFn = Callable[[str, Sample], float]
#: what ``reward.name`` resolves to once built (:func:`unirl.rewards.build.build_reward`)
Reward = RewardFn | BatchReward

_INT = re.compile(r"-?\d+")

#: math_verify's per-call timeout (seconds) when running in the main thread
MATH_VERIFY_TIMEOUT = 5


def gold_parser(parse: Callable[[Any], Any]) -> Callable[[RewardFn], RewardFn]:
    """Declare how a reward reads its gold answer: ``fn.parse_gold = parse``.

    ``parse(answer)`` returns the parsed gold, or raises ``ValueError`` saying what the reward needs.
    Why declared: the reward raises on a gold answer it cannot read, so every sample of that prompt
    fails at run time, and a dataset whose answers are all unreadable would train on nothing but
    failed rewards; preflight runs ``parse`` over every gold answer of the dataset files instead
    (:func:`unirl.data.datasets.data_violations`), before any model is built. A reward that cannot tell
    a readable gold answer from its input alone (a judge, a reward model) declares none, and is skipped.
    """

    def mark(fn: RewardFn) -> RewardFn:
        fn.parse_gold = parse  # type: ignore[attr-defined]
        return fn

    return mark


def _gold_int(answer: Any) -> int:
    """``exact_int``'s gold: an int, an integral float, or the text of one (``"19"``, ``"19.0"``)."""
    need = f"exact_int: the gold answer {answer!r} is not an integer"
    if isinstance(answer, bool):
        raise ValueError(f"exact_int: the gold answer {answer!r} is a bool, not an integer")
    if isinstance(answer, int):
        return answer
    if isinstance(answer, float):
        if not answer.is_integer():
            raise ValueError(need)
        return int(answer)
    text = str(answer).strip()  # a string, or a number type of another library (numpy's int64)
    try:
        return int(text)
    except ValueError:
        try:
            value = float(text)  # "19.0"
        except ValueError:
            raise ValueError(need) from None
        if not value.is_integer():
            raise ValueError(need) from None
        return int(value)


@gold_parser(_gold_int)
def exact_int(completion: str, sample: Sample) -> float:
    """1.0 when the first integer (``-?\\d+``) in the completion equals ``int(sample.answer)``.

    No integer in the completion scores 0.0. An answer that is not an integer raises (a data problem).
    """
    gold = _gold_int(sample.answer)
    m = _INT.search(completion)
    if m is None:
        return 0.0
    try:
        got = int(m.group())
    except ValueError:  # more digits than Python's int() accepts from a string
        return 0.0
    return 1.0 if got == gold else 0.0


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?")


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{"):i]
        i += 1
    return None  # unbalanced: no final answer


def final_answer(completion: str, *, boxed_only: bool = False) -> str | None:
    """The completion's final answer: the last ``\\boxed{}``, else (unless ``boxed_only``) the last number.

    Why not the whole completion: math_verify judges *expressions*, so a completion that echoes the
    question (``7+7`` for the gold ``14``) would verify as correct and the reward could be gamed.
    """
    boxed = last_boxed(completion)
    if boxed is not None or boxed_only:
        return boxed
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def _timeout() -> int | None:
    return MATH_VERIFY_TIMEOUT if threading.current_thread() is threading.main_thread() else None


def _gold_math(answer: Any) -> list[Any]:
    """``math_verify``'s gold: what ``math_verify.parse`` makes of ``str(answer)``; nothing parsed raises."""
    from math_verify import parse

    gold = parse(str(answer), parsing_timeout=_timeout())
    if not gold:
        raise ValueError(f"math_verify could not parse the gold answer {answer!r} (a number or a LaTeX "
                         "expression such as \\frac{1}{2})")
    return gold


def _verify(answer: str | None, sample: Sample) -> float:
    from math_verify import parse, verify

    timeout = _timeout()
    gold = _gold_math(sample.answer)
    if answer is None:
        return 0.0
    pred = parse(f"${answer}$", parsing_timeout=timeout)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0


@gold_parser(_gold_math)
def math_verify(completion: str, sample: Sample) -> float:
    """1.0 when the completion's final answer (last ``\\boxed{}``, else last number) equals the gold answer.

    Equality is ``math_verify``'s (``1/2`` equals ``0.5``). math_verify enforces its timeouts with
    ``signal.alarm``, which only works in the main thread; off the main thread (a Ray actor's worker
    thread, a thread pool) the timeouts are disabled rather than letting every call fail. A gold answer
    math_verify cannot parse raises, so a bad dataset surfaces as failed samples instead of a silent 0.
    """
    return _verify(final_answer(completion), sample)


@gold_parser(_gold_math)
def math_verify_boxed(completion: str, sample: Sample) -> float:
    """Like :func:`math_verify`, but only a ``\\boxed{}`` answer counts (no number fallback)."""
    return _verify(final_answer(completion, boxed_only=True), sample)


def score(samples: Iterable[Sample], fn: Reward) -> dict[str, int]:
    """Set ``sample.reward`` for each sample: ``fn(sample.response_text, sample)``, or for a
    :class:`BatchReward` one ``score_batch`` call over every sample still to score.

    Samples already ``status == "failed"`` (an engine error) are skipped and stay NaN. A reward that
    raises, or returns something that is not a finite number, marks that sample failed (NaN) and
    scoring continues (a batch reward that raises fails its whole batch). Returns
    ``{"scored", "failed", "skipped"}``.
    """
    counts = {"scored": 0, "failed": 0, "skipped": 0}
    todo: list[Sample] = []
    for s in samples:
        if s.status == "failed":
            s.reward = math.nan
            counts["skipped"] += 1
        else:
            todo.append(s)
    if isinstance(fn, BatchReward):
        values: list[Any] = _batch_values(fn, todo)
    else:
        values = [_one_value(fn, s) for s in todo]
    for s, value in zip(todo, values, strict=True):
        if isinstance(value, str):  # the reason it failed
            s.mark_failed(value)
            counts["failed"] += 1
        else:
            s.reward = value
            counts["scored"] += 1
    return counts


def _one_value(fn: RewardFn, s: Sample) -> float | str:
    """A finite reward, or why there is none."""
    try:
        value = float(fn(s.response_text, s))
    except Exception as exc:  # a reward bug must not take down the step
        return f"reward raised {type(exc).__name__}: {exc}"
    return value if math.isfinite(value) else f"reward returned {value}"


def _batch_values(fn: BatchReward, todo: list[Sample]) -> list[float | str]:
    if not todo:
        return []
    try:
        raw = list(fn.score_batch([s.response_text for s in todo], todo))
        if len(raw) != len(todo):
            raise ValueError(f"{type(fn).__name__}.score_batch returned {len(raw)} rewards for {len(todo)} samples")
        values = [float(v) for v in raw]
    except Exception as exc:  # noqa: BLE001 - the whole batch failed; the step goes on
        return [f"reward raised {type(exc).__name__}: {exc}"] * len(todo)
    return [v if math.isfinite(v) else str(s.meta.pop("reward_error", f"reward returned {v}"))
            for s, v in zip(todo, values, strict=True)]
