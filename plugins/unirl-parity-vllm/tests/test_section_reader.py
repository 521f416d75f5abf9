"""``plugins.parity`` is read through the kernel's section machinery (issue 72, item 2): preflight
validates the declared :class:`ParityProfile` once (``unirl.api.section_options``), the plugin reads the
same typed model back (``unirl.api.plugin_section``), and the profile file a recipe names is merged
under the recipe's own fields as a step on that typed model (the recipe wins, section by section)."""

from __future__ import annotations

from pathlib import Path

import pytest

from unirl.api import Qwen3Adapter, load_config, load_kernel, plugin_section
from unirl_parity_vllm import plugin, profile

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def flag_on(monkeypatch):
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    monkeypatch.delenv("UNIRL_PARITY_DIR", raising=False)


def test_profile_file_merges_under_the_recipe(tmp_path):
    path = tmp_path / "parity.yaml"
    path.write_text("strict: false\nexperimental: true\nsampling: {temperature: 0.5, top_k: 7}\n")
    config = load_config(str(ROOT / "recipes" / "parity-tiny-embedded.yaml"), [f"plugins.parity.profile={path}"])
    got = profile.declared(config, load_kernel())
    assert got.strict is False and got.experimental is True  # from the file: the recipe does not set them
    assert got.sampling.temperature == 0.8 and got.sampling.top_k == 50  # the recipe's whole sampling section
    assert got.dtype == "float32" and got.profile == str(path)
    assert plugin_section(config, "parity").profile == str(path)  # the typed section, kept for this config


def test_a_bad_recipe_field_is_reported_once_with_its_value(flag_on):
    config = load_config(str(ROOT / "recipes" / "parity-tiny-embedded.yaml"), ["plugins.parity.dtype=float16"])
    got = plugin.unirl_preflight(config, Qwen3Adapter(), load_kernel())
    assert [v.field for v in got] == ["plugins.parity.dtype"], [str(v) for v in got]
    assert "(got 'float16')" in got[0].message and "fields of plugins.parity" in got[0].fix


def test_a_bad_file_field_names_the_field(flag_on, tmp_path):
    path = tmp_path / "parity.yaml"
    path.write_text("strict: sometimes\n")
    config = load_config(str(ROOT / "recipes" / "parity-tiny-embedded.yaml"), [f"plugins.parity.profile={path}"])
    got = plugin.unirl_preflight(config, Qwen3Adapter(), load_kernel())
    assert [v.field for v in got] == ["plugins.parity.strict"], [str(v) for v in got]
    assert "(got 'sometimes')" in got[0].message
