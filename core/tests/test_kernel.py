"""Kernel: discovery through real entry points, registries, isolation, allowlist, preflight, CLI.

Test plugins are real installed distributions: a ``*.dist-info`` directory with ``entry_points.txt``
on ``sys.path`` is exactly what pip leaves behind, and ``importlib.metadata`` finds it the same way.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from unirl.config import load_config
from unirl.kernel import PluginError, PreflightError, Violation, load_kernel
from unirl.kernel.errors import OptionsError
from unirl.preflight import check, preflight, worker_env


@pytest.fixture
def make_dist(tmp_path, monkeypatch):
    """Install a tiny distribution (dist-info + module) on sys.path; returns its site dir."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    created = []

    def make(dist: str, module: str, source: str, ep_name: str | None = None, version: str = "1.0"):
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[unirl.plugins]\n{ep_name or module} = {module}\n")
        created.append(module)
        return site

    yield make
    for m in created:
        sys.modules.pop(m, None)


ENGINE_PLUGIN = """
from unirl.kernel import hookimpl
@hookimpl
def unirl_rollout_engines():
    return {{"{name}": "{module}:Engine"}}
class Engine:
    pass
"""


def test_core_builtins_are_discovered_through_entry_points():
    kernel = load_kernel()
    core = next(p for p in kernel.plugins if p.entry_point == "core")
    assert core.dist == "unirl-core" and core.status == "loaded"
    assert kernel.get("rollout_engines", "torch").dist == "unirl-core"
    assert {"grpo", "dr_grpo", "rloo", "gae"} <= set(kernel.names("advantage_estimators"))


def test_third_party_plugin_discovered_with_provenance(make_dist):
    make_dist("acme-engine", "acme_engine", ENGINE_PLUGIN.format(name="acme", module="acme_engine"), version="2.3")
    kernel = load_kernel()
    entry = kernel.get("rollout_engines", "acme")
    assert (entry.dist, entry.version) == ("acme-engine", "2.3")
    assert entry.load().__name__ == "Engine"
    rec = next(p for p in kernel.plugins if p.dist == "acme-engine")
    assert rec.registers == {"rollout_engines": ["acme"]}


def test_duplicate_name_names_both_distributions(make_dist):
    make_dist("dup-one", "dup_one", ENGINE_PLUGIN.format(name="same", module="dup_one"))
    make_dist("dup-two", "dup_two", ENGINE_PLUGIN.format(name="same", module="dup_two"))
    with pytest.raises(PluginError) as err:
        load_kernel()
    assert "dup-one" in str(err.value) and "dup-two" in str(err.value) and "'same'" in str(err.value)


def test_duplicate_of_a_builtin_is_rejected(make_dist):
    make_dist("evil-torch", "evil_torch", ENGINE_PLUGIN.format(name="torch", module="evil_torch"))
    with pytest.raises(PluginError, match="unirl-core.*evil-torch|evil-torch.*unirl-core"):
        load_kernel()


def test_broken_plugin_is_isolated_and_fatal_only_when_selected(make_dist):
    make_dist("unirl-broken", "broken_engine", "raise ImportError('libfoo.so not found')\n", ep_name="broken")
    kernel = load_kernel()
    rec = next(p for p in kernel.plugins if p.dist == "unirl-broken")
    assert rec.status == "failed" and "libfoo.so" in rec.error
    assert kernel.get("rollout_engines", "torch")  # the rest still works
    with pytest.raises(PluginError) as err:
        kernel.get("rollout_engines", "broken")
    assert "unirl-broken" in str(err.value) and "libfoo.so" in str(err.value)


def test_hook_returning_wrong_type_is_reported_with_distribution(make_dist):
    src = "from unirl.kernel import hookimpl\n@hookimpl\ndef unirl_rewards():\n    return ['not', 'a', 'dict']\n"
    make_dist("wrong-type", "wrong_type", src)
    kernel = load_kernel()
    rec = next(p for p in kernel.plugins if p.dist == "wrong-type")
    assert rec.status == "failed" and "unirl_rewards() must return a dict" in rec.error
    assert "wrong_type" not in [p.entry_point for p in kernel.plugins if p.status == "loaded"]


def test_allowlist(make_dist, monkeypatch):
    make_dist("acme-a", "acme_a", ENGINE_PLUGIN.format(name="a", module="acme_a"))
    make_dist("acme-b", "acme_b", ENGINE_PLUGIN.format(name="b", module="acme_b"))
    monkeypatch.setenv("UNIRL_PLUGINS", "acme_a")
    kernel = load_kernel()
    assert "a" in kernel.names("rollout_engines") and "b" not in kernel.names("rollout_engines")
    assert "torch" in kernel.names("rollout_engines"), "core is always loaded"
    rec = next(p for p in kernel.plugins if p.dist == "acme-b")
    assert rec.status == "disabled"
    with pytest.raises(PluginError, match="disabled by UNIRL_PLUGINS"):
        kernel.get("rollout_engines", "acme_b")


PREFLIGHT_PLUGIN = """
from unirl.kernel import hookimpl, Violation
@hookimpl
def unirl_preflight(config):
    return [Violation("{dist}", "{field}", "bad {n}", "fix {n}") for _ in range({n})][:{n}] if {n} else []
"""


def test_preflight_aggregates_violations_from_two_plugins_and_core(make_dist):
    make_dist("check-one", "check_one", PREFLIGHT_PLUGIN.format(dist="check-one", field="rollout.n", n=2))
    make_dist("check-two", "check_two", PREFLIGHT_PLUGIN.format(dist="check-two", field="actor.lr", n=1))
    kernel = load_kernel()
    config = load_config(None, ["rollout.engine=nope", "rollout.n=1"])
    violations = preflight(config, kernel)
    sources = [v.source for v in violations]
    assert sources.count("check-one") == 2 and sources.count("check-two") == 1
    fields = {v.field for v in violations if v.source == "unirl-core"}
    assert {"rollout.engine", "rollout.n"} <= fields
    with pytest.raises(PreflightError) as err:
        check(config, kernel)
    assert len(err.value.violations) == len(violations) >= 5
    assert "check-one" in str(err.value) and "check-two" in str(err.value) and "nope" in str(err.value)


def test_preflight_hook_that_raises_or_returns_garbage_is_a_violation(make_dist):
    src = "from unirl.kernel import hookimpl\n@hookimpl\ndef unirl_preflight(config):\n    raise RuntimeError('boom')\n"
    make_dist("raiser", "raiser", src)
    src2 = "from unirl.kernel import hookimpl\n@hookimpl\ndef unirl_preflight(config):\n    return 'oops'\n"
    make_dist("garbage", "garbage", src2)
    violations = preflight(load_config(None), load_kernel())
    by_source = {v.source: v for v in violations}
    assert "boom" in by_source["raiser"].message
    assert "not a list of Violation" in by_source["garbage"].message


def test_component_options_validated_against_plugin_config(make_dist):
    """The kernel validates ``rollout.options`` against the engine's ``Config`` once: preflight reports
    each bad field exactly once (sourced to the plugin), ``Kernel.build`` raises the same violations
    before the factory runs, and a good section reaches the factory and ``capabilities`` typed."""
    src = """
from pydantic import BaseModel
from unirl.contracts import EngineCapabilities, RolloutEngine
from unirl.kernel import hookimpl
SEEN = []
class Engine(RolloutEngine):
    @classmethod
    def capabilities(cls, config, options):
        SEEN.append(("capabilities", options))
        return EngineCapabilities(weight_syncs=("inprocess",))
    class Config(BaseModel):
        model_config = {"extra": "forbid"}
        batch: int = 4
    def __new__(cls, **kwargs):  # records what the factory is handed, builds nothing
        SEEN.append(("factory", kwargs["options"]))
        return "built"
@hookimpl
def unirl_rollout_engines():
    return {"opt": Engine}
"""
    make_dist("opt-engine", "opt_engine", src)
    import opt_engine

    kernel = load_kernel()
    ok = load_config(None, ["rollout.engine=opt", "rollout.options={batch: 8}"])
    assert not [v for v in preflight(ok, kernel) if v.field.startswith("rollout")]
    assert {(where, o.batch) for where, o in opt_engine.SEEN} == {("capabilities", 8)}
    assert type(opt_engine.SEEN[0][1]) is opt_engine.Engine.Config
    seen = len(opt_engine.SEEN)
    bad = load_config(None, ["rollout.engine=opt", "rollout.options={batch: many, colour: red}"])
    found = [v for v in preflight(bad, kernel) if v.field.startswith("rollout.options")]
    assert sorted(v.field for v in found) == ["rollout.options.batch", "rollout.options.colour"]  # once each
    assert {v.source for v in found} == {"opt-engine"}
    assert len(opt_engine.SEEN) == seen  # capabilities are read from valid options only
    with pytest.raises(OptionsError) as err:
        kernel.build("rollout_engines", "opt", options=bad.rollout.options, options_at="rollout.options")
    assert err.value.violations == found and len(opt_engine.SEEN) == seen  # the factory never ran
    assert kernel.build("rollout_engines", "opt", options=ok.rollout.options, options_at="rollout.options") == "built"
    assert [(where, o.batch) for where, o in opt_engine.SEEN[seen:]] == [("factory", 8)]


def test_a_component_without_options_refuses_them_once():
    """``weight_sync.options`` for ``inprocess`` (no ``Config``): one violation, naming the field."""
    kernel = load_kernel()
    bad = load_config(None, ["weight_sync.options={bucket_mb: 1}"])
    found = [v for v in preflight(bad, kernel) if v.field.startswith("weight_sync")]
    assert [(v.source, v.field, v.fix) for v in found] == [("unirl-core", "weight_sync.options", "remove them")]
    with pytest.raises(OptionsError) as err:
        kernel.build("weight_syncs", "inprocess", options=bad.weight_sync.options, options_at="weight_sync.options",
                     config=bad)
    assert err.value.violations == found


def test_worker_env_merges_and_rejects_conflicts(make_dist):
    tmpl = "from unirl.kernel import hookimpl\n@hookimpl\ndef unirl_worker_env(config):\n    return {{'FLAG': '{v}', '{k}': '1'}}\n"
    make_dist("env-one", "env_one", tmpl.format(v="1", k="ONE"))
    make_dist("env-two", "env_two", tmpl.format(v="1", k="TWO"))
    assert worker_env(load_config(None), load_kernel()) == {"FLAG": "1", "ONE": "1", "TWO": "1"}
    make_dist("env-three", "env_three", tmpl.format(v="0", k="THREE"))
    with pytest.raises(PluginError, match="FLAG.*env-three|env-three.*FLAG"):
        worker_env(load_config(None), load_kernel())


def test_violation_str_names_source_field_and_fix():
    v = Violation("unirl-vllm", "rollout.options.kv", "too big", "lower it")
    assert str(v) == "[unirl-vllm] rollout.options.kv: too big (fix: lower it)"


# ------------------------------------------------------------------------------------------- CLI


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unirl.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_import_unirl_and_plugins_command_import_neither_torch_nor_ray():
    code = (
        "import sys, io, contextlib\n"
        "import unirl, unirl.kernel, unirl.config, unirl.samples, unirl.contracts\n"
        "from unirl.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['plugins', '--json'])\n"
        "print([m for m in ('torch', 'ray', 'vllm', 'transformers') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_cli_plugins_json_lists_core():
    out = run_cli("plugins", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    core = next(r for r in rows if r["entry_point"] == "core")
    assert core["distribution"] == "unirl-core" and "torch" in core["registers"]["rollout_engines"]


def test_cli_bad_inputs_give_one_message_without_traceback(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("rollout: [unclosed\n")
    out = run_cli("config", str(bad_yaml))
    assert out.returncode == 2 and "bad.yaml" in out.stderr and "Traceback" not in out.stderr

    typo = tmp_path / "typo.yaml"
    typo.write_text("rollout:\n  temprature: 0.7\n")
    out = run_cli("config", str(typo))
    assert out.returncode == 2 and "rollout.temprature" in out.stderr and "temperature" in out.stderr
    assert "Traceback" not in out.stderr

    out = run_cli("preflight", str(typo.with_name("missing.yaml")))
    assert out.returncode == 2 and "missing.yaml" in out.stderr

    ok = tmp_path / "ok.yaml"
    ok.write_text("rollout:\n  engine: warp-drive\n")
    out = run_cli("preflight", str(ok))
    assert out.returncode == 2 and "warp-drive" in out.stderr and "rollout.engine" in out.stderr
    assert "Traceback" not in out.stderr
    out = run_cli("--debug", "preflight", str(ok))
    assert "Traceback" in out.stderr


def test_cli_config_applies_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  n: 4\n")
    out = run_cli("config", str(recipe), "rollout.n=6", "algorithm.modifiers=[a, b]")
    assert out.returncode == 0, out.stderr
    assert "n: 6" in out.stdout and "- a" in out.stdout


# --------------------------------------------------------------------------- the example plugin

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "unirl-example-adapter"


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True, timeout=300,
                   capture_output=True)


def test_example_plugin_install_discover_select_uninstall(tmp_path):
    _pip("install", "--no-deps", "--no-build-isolation", str(EXAMPLE))
    try:
        rows = json.loads(run_cli("plugins", "--json").stdout)
        rec = next(r for r in rows if r["distribution"] == "unirl-example-adapter")
        assert rec["status"] == "loaded" and rec["registers"]["model_adapters"] == ["example-llama"]
        # its parity provider is registered only where unirl-parity-vllm is installed
        assert rec["registers"].get("parity_providers", ["example-llama"]) == ["example-llama"]
        recipe = tmp_path / "r.yaml"
        recipe.write_text("model:\n  adapter: example-llama\n")
        out = run_cli("preflight", str(recipe))
        assert out.returncode == 0, out.stderr
        out = run_cli("preflight", str(recipe), "model.build={head_dim: 16}")
        assert out.returncode == 2 and "unirl-example-adapter" in out.stderr and "head_dim" in out.stderr
    finally:
        _pip("uninstall", "-y", "unirl-example-adapter")
    rows = json.loads(run_cli("plugins", "--json").stdout)
    assert not [r for r in rows if r["distribution"] == "unirl-example-adapter"]
    out = run_cli("preflight", str(tmp_path / "r.yaml"))
    assert out.returncode == 2 and "example-llama" in out.stderr


COMMAND_PLUGIN = """
from unirl.kernel import hookimpl
from unirl.kernel.errors import UniRLError
@hookimpl
def unirl_commands():
    return {"hello": "acme_cmd:hello", "boom": "acme_cmd:boom"}
def hello(argv):
    print("hello", *argv)
    return 3
def boom(argv):
    raise UniRLError("boom: " + " ".join(argv))
"""


def test_plugin_command_is_dispatched_by_the_cli(make_dist, capsys):
    from unirl.cli import main

    make_dist("acme-cmd", "acme_cmd", COMMAND_PLUGIN)
    kernel = load_kernel()
    assert kernel.get("commands", "hello").dist == "acme-cmd"
    assert main(["hello", "a", "--flag"]) == 3  # the rest of argv goes to the command as is
    assert capsys.readouterr().out.strip() == "hello a --flag"
    assert main(["boom", "x"]) == 2 and "boom: x" in capsys.readouterr().err  # one message, exit 2
    with pytest.raises(Exception, match="boom"):
        main(["--debug", "boom", "x"])
    with pytest.raises(SystemExit):  # an unknown command is still argparse's error
        main(["no-such-command"])
    assert main(["plugins", "--json"]) == 0  # built-ins are never shadowed
    rows = json.loads(capsys.readouterr().out)
    assert next(r for r in rows if r["distribution"] == "acme-cmd")["registers"] == {"commands": ["hello", "boom"]}


def test_an_allowlist_entry_that_matches_no_plugin_is_an_error(monkeypatch):
    """A typo in UNIRL_PLUGINS would silently drop the plugin meant: refused, naming what is installed."""
    from unirl.kernel import load_kernel

    monkeypatch.setenv("UNIRL_PLUGINS", "nosuchplugin")
    with pytest.raises(PluginError, match="UNIRL_PLUGINS=nosuchplugin: 'nosuchplugin' is not the entry point") as err:
        load_kernel()
    assert "installed entry points: " in str(err.value) and "fix: " in str(err.value)


def test_an_allowlist_may_name_an_in_process_plugin(monkeypatch):
    """``load_kernel(extra=...)`` registrations are names too (a Ray rank rebuilds them with the allowlist)."""
    import types

    monkeypatch.setenv("UNIRL_PLUGINS", "local_thing")
    kernel = load_kernel(extra=[("local_thing", types.ModuleType("local_thing"))])
    assert "local_thing" in [p.entry_point for p in kernel.plugins]
