"""``plugins.<name>`` sections against what loaded plugins declare (``unirl_config_sections``; issue 66).

A section no loaded plugin declares would be silently ignored (a typo, an uninstalled plugin): preflight
refuses it with the closest declared name. Declaring is core's contract, through the kernel's registry.
"""

from __future__ import annotations

import types

import pytest
from pydantic import Field

from unirl.config import load_config
from unirl.config_bounds import StrictOptions
from unirl.kernel.errors import PluginError
from unirl.kernel.hookspecs import hookimpl
from unirl.kernel.manager import load_kernel
from unirl.preflight import preflight


class ShapeOptions(StrictOptions):
    width: int = Field(3, ge=1)


def _plugin(name: str, sections: dict) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.unirl_config_sections = hookimpl(lambda: sections)
    return mod


def _section_fields(kernel, *overrides: str) -> dict[str, str]:
    return {v.field: f"{v.message} | {v.fix}" for v in preflight(load_config(None, list(overrides)), kernel)
            if v.field.startswith("plugins.")}


def test_the_installed_plugins_declare_their_sections():
    kernel = load_kernel()
    assert {"agentic", "rollout_correction", "parity"} <= set(kernel.names("config_sections"))
    for name in kernel.names("config_sections"):  # each declaration loads to the section's model
        assert issubclass(kernel.get("config_sections", name).load(), StrictOptions)


def test_a_declared_section_passes_and_an_undeclared_one_is_named():
    kernel = load_kernel(extra=[("shapes", _plugin("shapes_plugin", {"shapes": ShapeOptions}))])
    assert _section_fields(kernel, "plugins.shapes={width: 4}") == {}
    got = _section_fields(kernel, "plugins.shape={width: 4}")
    assert set(got) == {"plugins.shape"}
    assert "no loaded plugin reads 'shape'" in got["plugins.shape"] and "did you mean plugins.shapes?" in got[
        "plugins.shape"]
    far = _section_fields(kernel, "plugins.zzz={a: 1}")["plugins.zzz"]
    assert "would be ignored" in far and "shapes" in far  # lists what is read here


def test_without_the_plugin_its_section_is_refused():
    """The same recipe with the declaring plugin not loaded: nothing would read the section."""
    kernel = load_kernel(discover=False)
    got = _section_fields(kernel, "plugins.agentic={max_turns: 3}")
    assert "plugins.agentic" in got and "would be ignored" in got["plugins.agentic"]


def test_two_plugins_cannot_declare_one_section():
    with pytest.raises(PluginError, match="config_sections name 'shapes' is registered twice"):
        load_kernel(discover=False, extra=[("a", _plugin("a_plugin", {"shapes": ShapeOptions})),
                                           ("b", _plugin("b_plugin", {"shapes": ShapeOptions}))])
