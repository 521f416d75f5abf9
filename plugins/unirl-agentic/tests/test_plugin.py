"""The plugin as the kernel sees it: registered names, lazy import, preflight of plugins.agentic."""

from __future__ import annotations

import subprocess
import sys

from unirl.api import RunConfig, load_kernel
from unirl.preflight import preflight


def test_kernel_discovers_the_environment_and_tools():
    k = load_kernel()
    assert k.get("environments", "tool_env").load().__name__ == "ToolEnvironment"
    calc = k.build("tools", "calculator", config=RunConfig())
    assert calc.call({"expression": "6*7"}).content == "42"
    assert k.get("tools", "python_sandbox").load().__name__ == "PythonSandbox"


def test_plugin_import_is_light():
    code = "import sys, unirl_agentic.plugin; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_preflight_names_bad_fields_with_a_fix():
    k = load_kernel()
    cfg = RunConfig(rollout={"environment": "tool_env", "tools": []},
                    plugins={"agentic": {"max_turns": 0, "tools": {"python_sandbox": {"timeout_s": -1}}}})
    got = {v.field: v for v in preflight(cfg, k) if v.source == "unirl-agentic"}
    assert "plugins.agentic.max_turns" in got
    cfg = RunConfig(rollout={"environment": "tool_env", "tools": []},
                    plugins={"agentic": {"tools": {"python_sandbox": {"timeout_s": -1}}}})
    got = {v.field: v for v in preflight(cfg, k) if v.source == "unirl-agentic"}
    assert "plugins.agentic.tools.python_sandbox.timeout_s" in got
    assert "rollout.tools" in got and "calculator" in got["rollout.tools"].fix
    ok = RunConfig(rollout={"environment": "tool_env", "tools": ["calculator"]}, plugins={"agentic": {"max_turns": 3}})
    assert [v for v in preflight(ok, k) if v.source == "unirl-agentic"] == []


def test_the_trainer_seam_registers_the_controller_and_preflight_names_the_fix():
    from unirl.api import RolloutController

    k = load_kernel()
    cls = k.get("rollout_controllers", "agentic").load()
    assert issubclass(cls, RolloutController) and cls.__name__ == "KernelAgenticController"
    bad = RunConfig(rollout={"controller": "agentic"})
    got = {v.field: v for v in preflight(bad, k) if v.source == "unirl-agentic"}
    assert "rollout.environment" in got["rollout.controller"].fix
    ok = RunConfig(rollout={"controller": "agentic", "environment": "tool_env", "tools": ["calculator"]})
    assert [v for v in preflight(ok, k) if v.field.startswith("rollout.")] == []
