"""Verdict parsing: negative forms first, adversarial phrasings, a configurable rule, clear config errors."""

from __future__ import annotations

import pytest

from unirl.config import VerdictSection, load_config
from unirl.kernel.errors import ConfigError
from unirl.rewards.verdict import normalize, parse_verdict

NEGATIVE = [
    "incorrect",
    "Incorrect.",
    "INCORRECT",
    "not correct",
    "Not correct!",
    "The answer is not correct.",
    "This is NOT quite correct",
    "not entirely correct, the sum is 12",
    "isn't correct",
    "isn\u2019t correct",  # typographic apostrophe
    "It wasn't right.",
    "in-correct",
    "in correct",
    "In\u00adcorrect",  # soft hyphen hidden inside the word
    "in\u200bcorrect",  # zero-width space
    "**Incorrect**",
    "Correct? No.",  # a positive word first, the rejection after it
    "correct... just kidding, wrong",
    "Wrong",
    "false",
    "No.",
    "no, the answer is correct only for 3+3",
    "The correct answer is 12",  # names the right answer: the candidate was not it
    "partially correct",
    "almost right",
    "not incorrect",  # a double negation scores 0: never a false reward
    "Verdict: incorrectly solved",
    "\uff49\uff4e\uff43\uff4f\uff52\uff52\uff45\uff43\uff54",  # fullwidth letters (NFKC folds them)
    "correct\nActually, incorrect",
    "That's never correct",
    "invalid",
]

POSITIVE = [
    "correct",
    " correct",
    "Correct.",
    "CORRECT",
    "Yes",
    "yes, that's right",
    "The answer is correct.",
    "Verdict: correct",
    "**Correct**",
    "correct!",
    "True",
    "Correct, no mistakes.",  # "no" that does not open a rejection
    "correct: no doubt",
    "\uff43\uff4f\uff52\uff52\uff45\uff43\uff54",  # fullwidth "correct"
]

UNPARSED = ["", "   ", "correctness unknown", "uncertain", "maybe", "12", "Q: 3+4=? A: 7"]


@pytest.mark.parametrize("text", NEGATIVE)
def test_negative_forms_never_parse_as_correct(text):
    assert parse_verdict(text) == 0.0


@pytest.mark.parametrize("text", POSITIVE)
def test_positive_forms(text):
    assert parse_verdict(text) == 1.0


@pytest.mark.parametrize("text", UNPARSED)
def test_no_verdict_is_unparsed(text):
    assert parse_verdict(text) is None


def test_enough_adversarial_cases():
    assert len(NEGATIVE) + len(POSITIVE) + len(UNPARSED) >= 20


def test_normalize_folds_what_would_hide_a_negation():
    assert normalize("  In\u00adCORRECT\u200b  is\u2019nt ") == "incorrect is'nt"


def test_rule_is_configurable():
    rule = VerdictSection(positive=[r"\bgood\b"], negative=[r"\bbad\b"])
    assert parse_verdict("good", rule) == 1.0
    assert parse_verdict("good, not bad", rule) == 0.0  # negative first, with the user's patterns too
    assert parse_verdict("correct", rule) is None  # the defaults are replaced, not merged
    first = VerdictSection(scope="first_line")
    assert parse_verdict("correct\nbut wrong later", first) == 1.0
    assert parse_verdict("\n\nincorrect\ncorrect", first) == 0.0


def test_bad_rule_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match=r"reward\.judge\.verdict.*negative\[1\].*not a valid regex"):
        load_config(None, ["reward.judge.verdict.negative=['ok', '(']"])
    with pytest.raises(ConfigError, match=r"positive is empty"):
        load_config(None, ["reward.judge.verdict.positive=[]"])
    with pytest.raises(ConfigError, match=r"reward\.judge\.verdict\.unparsed"):
        load_config(None, ["reward.judge.verdict.unparsed=maybe"])
    with pytest.raises(ConfigError, match=r"reward\.judge\.sampl: unknown key. Did you mean 'sampling'"):
        load_config(None, ["reward.judge.sampl.max_new_tokens=3"])
