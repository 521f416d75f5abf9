"""The tiny judge's builder (``unirl tiny-judge``): its training rows and a short build.

The learning claim (0.96 held-out agreement after 450 steps) is measured in docs/rewards.md, not here;
these tests pin what the builder feeds the model and that its output is a judge directory.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from unirl.config import load_config
from unirl.rewards.tiny_judge import build_tiny_judge, judge_rows, policy_misses, wrong_answers

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "arith-judge-tiny.yaml"


def test_wrong_answers_are_distinct_misses_mostly_of_the_golds_length():
    rng = random.Random(0)
    for gold in (4, 17, -7, 36, 120, 0):
        got = wrong_answers(gold, rng, 3)
        assert len(got) == len(set(got)) == 3 and gold not in got, (gold, got)
        # k - 1 hard candidates of the gold's length: no length shortcut
        assert sum(len(str(w)) == len(str(gold)) for w in got) >= 2, (gold, got)


def test_every_near_miss_the_policy_writes_is_in_the_judges_data():
    # the old judge's false positives on policy samples were all off by one or two (docs/rewards.md)
    rng = random.Random(0)
    for gold in (4, 9, 10, -1, 0, 17):
        got = policy_misses(gold, rng, 3)
        assert {gold - 2, gold - 1, gold + 1, gold + 2} <= set(got), (gold, got)
        assert gold not in got and len(got) == len(set(got)) == 7, (gold, got)


def test_judge_rows_are_balanced_and_render_the_recipes_template():
    config = load_config(RECIPE, ["data.arith.n_train=40"])
    rows = judge_rows(config, seed=0)
    verdicts = [r["answer"] for r in rows]
    assert verdicts.count("correct") == verdicts.count("incorrect") > 0
    assert all("{" not in r["prompt"] for r in rows)  # every template field filled


def test_a_short_build_writes_a_judge_directory(tmp_path):
    config = load_config(RECIPE, ["data.arith.n_train=40"])
    out = build_tiny_judge(config, tmp_path / "hf", steps=2, batch_size=8)
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 64


def test_a_rebuild_never_deletes_a_users_model_directory(tmp_path):
    """``reward.judge.model.path`` may name the user's own model: a rebuild refuses it before any SFT
    (the old builder deleted any directory with a config.json), and replaces only an earlier tiny judge."""
    from unirl.outputs import OutputExistsError

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_bytes(b'{"model_type": "llama"}')
    (mine / "model.safetensors").write_bytes(b"user weights")
    config = load_config(RECIPE, [])
    with pytest.raises(OutputExistsError, match="--force"):
        build_tiny_judge(config, mine, steps=1, batch_size=4)
    assert (mine / "model.safetensors").read_bytes() == b"user weights"
    out = build_tiny_judge(config, tmp_path / "judge", steps=1, batch_size=4)
    assert build_tiny_judge(config, out, steps=1, batch_size=4) == out  # an earlier judge: replaced
