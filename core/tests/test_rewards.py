"""Built-in rewards (exact_int, math_verify with the real package) and the scoring loop."""

from __future__ import annotations

import math
import threading

import pytest

from unirl.rewards.builtin import exact_int, final_answer, math_verify, math_verify_boxed, score
from unirl.samples import Sample


def sample(answer, response_text="", status="pending", sid="p0/0"):
    return Sample(id=sid, prompt_ids=[1], answer=answer, response_text=response_text, status=status)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("The answer is 19.", 19, 1.0),
        (" 19", "19", 1.0),
        ("-3", -3, 1.0),
        ("-3", 3, 0.0),
        ("19 or 20", 19, 1.0),  # the first integer counts
        ("20 or 19", 19, 0.0),
        ("no number", 19, 0.0),
        ("", 0, 0.0),
        ("007", 7, 1.0),
        ("19", "19.0", 1.0),
        ("9" * 5000, 9, 0.0),  # longer than int() accepts: no crash
    ],
)
def test_exact_int(completion, answer, expected):
    assert exact_int(completion, sample(answer)) == expected


def test_exact_int_non_integer_answer_raises():
    with pytest.raises(ValueError):
        exact_int("1", sample("one half"))
    with pytest.raises(ValueError, match="not an integer"):
        exact_int("1", sample(0.5))


def test_math_verify():
    assert math_verify("so the result is \\boxed{1/2}", sample(0.5)) == 1.0
    assert math_verify("\\boxed{1/3}", sample(0.5)) == 0.0
    assert math_verify("I do not know", sample("0.5")) == 0.0
    assert math_verify("$x = 4$", sample("4")) == 1.0


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("7+7", 14, 0.0),  # echoing the question is not an answer (math_verify alone says 7+7 == 14)
        ("7+7 = 14", 14, 1.0),
        ("7+7=\\boxed{14}", 14, 1.0),
        ("\\boxed{13} no wait \\boxed{14}", 14, 1.0),  # the last boxed answer counts
        ("\\boxed{14} then 3", 14, 1.0),  # a boxed answer wins over a later number
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("it is 2.50", "5/2", 1.0),
        ("3 / 4", 0.75, 1.0),
        ("\\boxed{14", 14, 1.0),  # unbalanced box: falls back to the last number
    ],
)
def test_math_verify_judges_the_final_answer(completion, gold, expected):
    assert math_verify(completion, sample(gold)) == expected


def test_math_verify_boxed_ignores_bare_numbers():
    assert math_verify_boxed("the answer is 14", sample(14)) == 0.0
    assert math_verify_boxed("so \\boxed{14}", sample(14)) == 1.0
    assert final_answer("7+7") == "7" and final_answer("none") is None


def test_math_verify_is_the_documented_echo_case():
    """math_verify itself scores the expression 7+7 as equal to 14: the reason for extraction."""
    from math_verify import parse, verify

    assert verify(parse("14"), parse("7+7"))


def test_math_verify_bad_gold_raises():
    with pytest.raises(ValueError, match="could not parse the gold answer"):
        math_verify("\\boxed{1}", sample("???"))


def test_math_verify_off_main_thread():
    # math_verify's signal.alarm timeouts fail off the main thread; the reward must still work there
    out: list = []
    t = threading.Thread(target=lambda: out.append(math_verify("\\boxed{1/2}", sample(0.5))))
    t.start()
    t.join(timeout=60)
    assert out == [1.0]


def test_score_marks_raising_reward_failed_and_continues():
    samples = [
        sample(19, "19", sid="p0/0"),
        sample(19, "boom", sid="p0/1"),
        sample(19, "7", sid="p0/2"),
        sample(19, "19", status="failed", sid="p0/3"),  # engine error: stays NaN, not scored
    ]
    calls = []

    def reward(completion, s):
        calls.append(s.id)
        if completion == "boom":
            raise RuntimeError("checker crashed")
        return exact_int(completion, s)

    counts = score(samples, reward)
    assert counts == {"scored": 2, "failed": 1, "skipped": 1}
    assert calls == ["p0/0", "p0/1", "p0/2"]
    assert [s.reward for s in (samples[0], samples[2])] == [1.0, 0.0]
    assert samples[1].status == "failed" and math.isnan(samples[1].reward)
    assert samples[1].meta["error"] == "reward raised RuntimeError: checker crashed"
    assert samples[3].status == "failed" and math.isnan(samples[3].reward)
    assert samples[0].status == "pending"  # score sets rewards only


def test_score_rejects_non_finite_or_non_numeric():
    samples = [sample(1, sid="p0/0"), sample(1, sid="p0/1")]
    counts = score(samples[:1], lambda c, s: math.nan)
    counts2 = score(samples[1:], lambda c, s: None)
    assert counts == counts2 == {"scored": 0, "failed": 1, "skipped": 0}
    assert samples[0].meta["error"] == "reward returned nan"
    assert samples[1].meta["error"].startswith("reward raised TypeError")


def test_registered_names_resolve():
    from importlib import import_module

    from unirl.builtins import unirl_rewards

    for name, target in unirl_rewards().items():
        module, _, attr = target.partition(":")
        assert callable(getattr(import_module(module), attr)), name
