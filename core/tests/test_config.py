"""Config errors name the file and the field, and offer the closest valid key."""

import pytest

from unirl.config import load_config
from unirl.kernel import ConfigError


def test_defaults_and_overrides():
    c = load_config(None, ["rollout.n=4", "algorithm.clip_high=0.28", 'rollout.stop=["\\n"]'])
    assert c.rollout.n == 4 and c.algorithm.clip_high == 0.28 and c.rollout.stop == ["\n"]


def test_unknown_key_did_you_mean(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("algorithm:\n  clip_hihg: 0.3\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    msg = str(err.value)
    assert "r.yaml" in msg and "algorithm.clip_hihg" in msg and "Did you mean 'clip_high'" in msg


def test_unknown_section_and_bad_type(tmp_path):
    with pytest.raises(ConfigError, match="Did you mean 'rollout'"):
        load_config(None, ["rolout.n=3"])
    with pytest.raises(ConfigError, match="rollout.n.*got 'many'"):
        load_config(None, ["rollout.n=many"])
    with pytest.raises(ConfigError, match="rollout.n"):
        load_config(None, ["rollout.n=0"])


def test_malformed_inputs(tmp_path):
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(None, ["rollout.n"])
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="list.yaml must be a mapping"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config(None, ["rollout.n=2", "rollout.n.x=1"])


def test_recipes_in_repo_validate():
    from pathlib import Path

    recipes = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
    assert recipes
    for r in recipes:
        load_config(r)


def test_extends_merges_base_recipe(tmp_path):
    (tmp_path / "base.yaml").write_text("rollout:\n  n: 4\n  temperature: 0.5\nactor:\n  lr: 0.1\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nrollout:\n  n: 6\n")
    c = load_config(tmp_path / "child.yaml")
    assert (c.rollout.n, c.rollout.temperature, c.actor.lr) == (6, 0.5, 0.1)
    (tmp_path / "loop.yaml").write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(tmp_path / "loop.yaml")


@pytest.mark.parametrize("value", ["0", "1", "2", "-0.1"])
def test_clip_low_outside_the_open_unit_interval_is_rejected(value):
    """clip_low >= 1 gives a ratio floor <= 0 (clip_low=2: -1), which silently trained before."""
    with pytest.raises(ConfigError, match="algorithm.clip_low"):
        load_config(None, [f"algorithm.clip_low={value}"])
