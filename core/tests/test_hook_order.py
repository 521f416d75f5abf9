"""One hook walk for every hook call: tryfirst / plain / trylast, each in registration order; wrappers refused.

Why: ``Kernel.call``, ``Kernel.call_each`` and preflight used to walk the implementations in two
different orders, so a ``tryfirst=True`` plugin ran last through one of them. Each test here would
fail if one of the three callers walked its own way again.
"""

from __future__ import annotations

import types

import pytest

from unirl.api import PluginError, Violation, hookimpl, load_config, load_kernel
from unirl.preflight import plugin_violations, worker_env


def plugin(name: str, **marks) -> types.ModuleType:
    """A plugin whose lifecycle hooks record ``name`` (and preflight answers with a violation)."""
    mod = types.ModuleType(name)

    @hookimpl(**marks)
    def unirl_on_step_end(metrics):
        metrics.setdefault("order", []).append(name)

    @hookimpl(**marks)
    def unirl_preflight(config):
        return [Violation(name, "x", "seen")]

    @hookimpl(**marks)
    def unirl_worker_env(config):
        return {f"SEEN_{name.upper()}": "1"}

    mod.unirl_on_step_end, mod.unirl_preflight, mod.unirl_worker_env = unirl_on_step_end, unirl_preflight, unirl_worker_env
    return mod


def kernel_of(*mods):
    return load_kernel(discover=False, extra=[(m.__name__, m) for m in mods])


def test_two_plain_plugins_run_in_registration_order():
    kernel = kernel_of(plugin("a"), plugin("b"))
    metrics: dict = {}
    kernel.call("unirl_on_step_end", step=0, metrics=metrics, config=None)
    assert metrics["order"] == ["a", "b"]


def test_tryfirst_and_trylast_through_every_caller():
    kernel = kernel_of(plugin("last", trylast=True), plugin("a"), plugin("first", tryfirst=True), plugin("b"))
    expected = ["first", "a", "b", "last"]
    assert [i.plugin_name for i in kernel.walk("unirl_on_step_end")] == expected
    metrics: dict = {}
    kernel.call("unirl_on_step_end", step=0, metrics=metrics, config=None)
    assert metrics["order"] == expected
    assert [d for d, _ in kernel.call_each("unirl_worker_env", config=None)] == expected
    config = load_config(None, [])
    assert [v.source for v in plugin_violations(config, kernel)] == expected
    assert list(worker_env(config, kernel)) == [f"SEEN_{n.upper()}" for n in expected]


@pytest.mark.parametrize("marks", [{"wrapper": True}, {"hookwrapper": True}])
def test_a_wrapper_is_refused_at_register_naming_the_plugin_and_the_fix(marks):
    mod = types.ModuleType("wrapping")

    @hookimpl(**marks)
    def unirl_on_step_end(metrics):
        yield

    mod.unirl_on_step_end = unirl_on_step_end
    with pytest.raises(PluginError, match=r"plugin 'wrapping'.*unirl_on_step_end.*fix: drop wrapper="):
        kernel_of(mod)


def test_a_raising_preflight_check_is_a_violation_and_the_walk_goes_on():
    bad = types.ModuleType("bad")

    @hookimpl(tryfirst=True)
    def unirl_preflight(config):
        raise RuntimeError("boom")

    bad.unirl_preflight = unirl_preflight
    kernel = kernel_of(bad, plugin("a"))
    got = plugin_violations(load_config(None, []), kernel)
    assert [(v.source, v.message) for v in got] == [("bad", "raised RuntimeError: boom"), ("a", "seen")]


def test_a_raising_lifecycle_hook_names_its_plugin():
    bad = types.ModuleType("bad")

    @hookimpl
    def unirl_on_step_end(metrics):
        raise ValueError("nope")

    bad.unirl_on_step_end = unirl_on_step_end
    with pytest.raises(ValueError) as info:
        kernel_of(bad).call("unirl_on_step_end", step=0, metrics={}, config=None)
    assert "plugin 'bad'" in "".join(info.value.__notes__)


def test_an_installed_wrapper_plugin_is_isolated_not_fatal(tmp_path, monkeypatch):
    """Discovery records it failed, with the same words, and the run's other plugins load."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "wrapping_plugin.py").write_text(
        "from unirl.api import hookimpl\n"
        "@hookimpl(wrapper=True)\ndef unirl_on_step_end(metrics):\n    return (yield)\n")
    info = site / "wrapping_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: wrapping-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[unirl.plugins]\nwrapping = wrapping_plugin\n")
    monkeypatch.syspath_prepend(str(site))
    try:
        kernel = load_kernel()
    finally:
        import sys

        sys.modules.pop("wrapping_plugin", None)
    record = next(p for p in kernel.plugins if p.entry_point == "wrapping")
    assert record.status == "failed" and "hook wrapper" in record.error and "fix: drop wrapper=" in record.error
    assert next(p for p in kernel.plugins if p.entry_point == "core").status == "loaded"
    assert not kernel.implements("unirl_on_step_end") or all(
        i.plugin_name != "wrapping" for i in kernel.walk("unirl_on_step_end"))
