"""A plugin's ``plugins.<name>`` section, validated by the kernel against the model the plugin declares
(``unirl_config_sections``), with the machinery of component options, and handed back typed (issue 72):
the plugin's preflight reports each bad key once, and its readers get the same typed model."""

from __future__ import annotations

import types

import pytest
from pydantic import Field

from unirl.api import RunConfig
from unirl.config import load_config
from unirl.config_bounds import StrictOptions
from unirl.kernel.errors import OptionsError
from unirl.kernel.hookspecs import hookimpl
from unirl.kernel.manager import load_kernel
from unirl.plugin_sections import plugin_section, section_options
from unirl.preflight import preflight


class ShapeOptions(StrictOptions):
    width: int = Field(3, ge=1)


def _kernel():
    mod = types.ModuleType("shapes_plugin2")
    mod.unirl_config_sections = hookimpl(lambda: {"shapes": ShapeOptions})
    return load_kernel(discover=False, extra=[("shapes", mod)])


def test_the_section_comes_back_typed_once_per_config():
    kernel = _kernel()
    config = load_config(None, ["plugins.shapes={width: 4}"])
    typed = section_options(kernel, config, "shapes")
    assert isinstance(typed, ShapeOptions) and typed.width == 4
    assert plugin_section(config, "shapes") is typed  # a reader without a kernel: the validated model
    assert section_options(kernel, load_config(None, []), "shapes").width == 3  # absent: the defaults


@pytest.mark.parametrize(("value", "field", "words"), [
    ("{width: 0}", "plugins.shapes.width", "greater than or equal to 1"),
    ("{widht: 4}", "plugins.shapes.widht", "Extra inputs"),
    ("{width: .nan}", "plugins.shapes.width", ""),
])
def test_a_bad_section_names_the_field_and_the_declaring_plugin(value, field, words):
    with pytest.raises(OptionsError) as info:
        section_options(_kernel(), load_config(None, [f"plugins.shapes={value}"]), "shapes")
    (v,) = info.value.violations
    assert (v.field, v.source) == (field, "shapes") and words in v.message and v.fix


def test_agentic_reports_a_bad_key_once_and_its_tools_read_the_typed_section():
    kernel = load_kernel()
    bad = RunConfig(rollout={"controller": "agentic", "environment": "tool_env", "tools": ["calculator"]},
                    plugins={"agentic": {"max_turns": 0}})
    assert [v.field for v in preflight(bad, kernel) if v.field.startswith("plugins.agentic")] == [
        "plugins.agentic.max_turns"]
    ok = RunConfig(rollout={"controller": "agentic", "environment": "tool_env", "tools": ["calculator"]},
                   plugins={"agentic": {"tools": {"calculator": {"max_chars": 5}}}})
    assert preflight(ok, kernel) == []
    calc = kernel.build("tools", "calculator", config=ok)
    assert calc.options.max_chars == 5 and calc.call({"expression": "123456"}).error
