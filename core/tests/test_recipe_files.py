"""Recipe files read strictly (issue 66): what PyYAML accepts silently is an error, what YAML means is kept.

The CLI side (exit 2, one line, no model) is in test_bad_input_matrix.py; these pin the loader itself.
"""

from __future__ import annotations

import pytest

from unirl.config import load_config
from unirl.kernel.errors import ConfigError
from unirl.recipe_files import DuplicateKeyError, load_yaml, read_recipe


def test_a_merge_key_is_not_a_duplicate():
    """``<<: *base`` merges a mapping (YAML's own rule), and a key given after it overrides the merged one."""
    text = "base: &b {n: 4, temperature: 0.7}\nrollout:\n  <<: *b\n  n: 8\n"
    assert load_yaml(text)["rollout"] == {"n": 8, "temperature": 0.7}


@pytest.mark.parametrize(("text", "key", "line"), [
    ("a: 1\nb: 2\na: 3\n", "'a'", 3),
    ("rollout:\n  n: 4\n  stop: []\n  n: 8\n", "'n'", 4),
    ("rows:\n  - {x: 1, x: 2}\n", "'x'", 2),  # inside a list
    ("1: a\n1: b\n", "1", 2),  # a non-string key
])
def test_a_key_given_twice_is_named_with_both_lines(text, key, line):
    with pytest.raises(DuplicateKeyError) as err:
        load_yaml(text)
    assert f"duplicate key {key} (first given at line" in str(err.value.problem)
    assert err.value.problem_mark.line + 1 == line  # the second one's line


def test_empty_and_comment_only_recipes_are_errors_and_extends_alone_is_not(tmp_path):
    for name, text in (("empty.yaml", ""), ("blank.yaml", "\n\n  \n"), ("comments.yaml", "# a\n# b\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=rf"{name} is empty"):
            read_recipe(tmp_path / name)
    (tmp_path / "base.yaml").write_text("rollout:\n  n: 4\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\n")
    assert load_config(tmp_path / "child.yaml").rollout.n == 4


def test_not_utf8_names_the_line_of_the_first_bad_byte(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_bytes(b"run:\n  name: ok\n  output_dir: caf\xe9\n")
    with pytest.raises(ConfigError) as err:
        read_recipe(p)
    assert "not UTF-8" in str(err.value) and "byte 0xe9 at line 3" in str(err.value) and "\n" not in str(err.value)


def test_a_directory_is_called_a_directory(tmp_path):
    d = tmp_path / "recipes"
    d.mkdir()
    (d / "one.yaml").write_text("rollout:\n  n: 4\n")
    (tmp_path / "child.yaml").write_text("extends: recipes\n")
    with pytest.raises(ConfigError, match="is a directory, not a recipe file; it holds one.yaml"):
        load_config(d)
    with pytest.raises(ConfigError, match="'extends: recipes' names .*recipes, which is a directory"):
        load_config(tmp_path / "child.yaml")
