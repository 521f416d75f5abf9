"""Packaging (issue 33), the fast part: what ``plugins/unirl-parity-vllm/tests/test_fresh_venv.py`` checks
from built wheels, checked here from the checkout in seconds.

- A plugin whose ``unirl-core`` range excludes the installed core is refused by discovery from its
  metadata, with the fix, and its code is never imported (an import crash is what the range prevents).
- One version: the repository's ``VERSION`` is every owned distribution's version, and each plugin's core
  range admits it (a version bump that forgets the ranges fails here, not on a user's machine).
- Packaged recipes: the package's ``recipes`` link shows exactly the repository's ``recipes/``; a bare name
  resolves to one, a path never silently does; ``unirl recipes copy`` writes the ``extends`` chain and
  never replaces a user's edit.
"""

from __future__ import annotations

import re
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from unirl.cli import main
from unirl.config import PACKAGED_RECIPES, copy_recipe, load_config, packaged_recipes, resolve_recipe
from unirl.kernel import ConfigError, PluginError, load_kernel
from unirl.kernel.manager import core_version

ROOT = Path(__file__).resolve().parents[2]
VERSION = (ROOT / "VERSION").read_text().strip()
#: the distributions whose pyproject takes its version from VERSION
OWNED = ["core", "plugins/unirl-agentic", "plugins/unirl-fsdp", "plugins/unirl-parity-vllm",
         "plugins/unirl-replay-trace", "plugins/unirl-rollout-correction", "plugins/unirl-sglang", "plugins/unirl-trackers",
         "plugins/unirl-vllm"]


@pytest.fixture
def plugin_dist(tmp_path, monkeypatch):
    """Install a distribution (dist-info with ``Requires-Dist`` + a module) on sys.path, as pip would."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    created = []

    def make(dist: str, module: str, source: str, requires: list[str]) -> None:
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        lines = "".join(f"Requires-Dist: {r}\n" for r in requires)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n{lines}")
        (info / "entry_points.txt").write_text(f"[unirl.plugins]\n{module} = {module}\n")
        created.append(module)

    yield make
    for m in created:
        sys.modules.pop(m, None)


ENGINE = """
from unirl.kernel import hookimpl
{crash}
@hookimpl
def unirl_rollout_engines():
    return {{"{name}": "{module}:Engine"}}
class Engine:
    pass
"""


def test_a_plugin_for_another_core_is_refused_from_its_metadata_before_import(plugin_dist):
    # importing this module would crash: the range check must stop discovery before it gets that far
    plugin_dist("acme-future", "acme_future", ENGINE.format(crash="raise ImportError('built for core 9')",
                                                              name="future", module="acme_future"),
                ["unirl-core>=9.0,<10", "pydantic>=2"])
    plugin_dist("acme-fits", "acme_fits", ENGINE.format(crash="", name="fits", module="acme_fits"),
                [f"unirl-core>={VERSION},<99", "unirl-core[test]>=99; extra == 'test'"])
    kernel = load_kernel()
    rec = next(p for p in kernel.plugins if p.dist == "acme-future")
    assert rec.status == "failed" and "acme_future" not in sys.modules
    assert rec.error == (f"incompatible core: acme-future 1.0 needs unirl-core<10,>=9.0, but unirl-core {core_version()} "
                         "is installed, so it was not loaded (fix: pip install 'acme-future' again to get a release for "
                         f"unirl-core {core_version()}, or pip install 'unirl-core<10,>=9.0')")
    # the range in an extra does not apply; a fitting range loads
    assert next(p for p in kernel.plugins if p.dist == "acme-fits").status == "loaded"
    assert kernel.get("rollout_engines", "fits").dist == "acme-fits"
    with pytest.raises(PluginError, match="future.*incompatible core"):  # selecting it says why it is missing
        kernel.get("rollout_engines", "future")


def test_one_version_and_every_plugin_admits_it():
    assert core_version() == VERSION  # the installed metadata of the checkout is built from VERSION
    import unirl

    assert unirl.__version__ == VERSION
    for d in OWNED:
        data = tomllib.loads((ROOT / d / "pyproject.toml").read_text())
        assert "version" not in data["project"] and "version" in data["project"]["dynamic"], d
        assert data["tool"]["setuptools"]["dynamic"]["version"] == {"file": "VERSION"}, d
        assert (ROOT / d / "VERSION").resolve() == (ROOT / "VERSION").resolve(), d  # a link, not a copy
        if d == "core":
            continue
        core = [Requirement(r) for r in data["project"]["dependencies"] if Requirement(r).name == "unirl-core"]
        assert len(core) == 1 and core[0].specifier and Version(VERSION) in core[0].specifier, (d, core)
        assert any(s.operator == "<" for s in core[0].specifier), (d, core)  # an upper bound: the next minor
    # unirl-agentic's pyproject belongs to another work item and still states its version: it must agree
    agentic = tomllib.loads((ROOT / "plugins/unirl-agentic/pyproject.toml").read_text())["project"]
    assert agentic.get("version", VERSION) == VERSION
    adapter = tomllib.loads((ROOT / "docs/examples/unirl-example-adapter/pyproject.toml").read_text())
    core = [Requirement(r) for r in adapter["project"]["dependencies"] if Requirement(r).name == "unirl-core"]
    assert core and Version(VERSION) in core[0].specifier


def test_parity_plugin_is_light_by_default():
    data = tomllib.loads((ROOT / "plugins/unirl-parity-vllm/pyproject.toml").read_text())["project"]
    names = {Requirement(r).name for r in data["dependencies"]}
    assert names == {"unirl-core", "pydantic"}, names
    assert [Requirement(r).name for r in data["optional-dependencies"]["vllm"]] == ["unirl-vllm"]
    assert Requirement(data["optional-dependencies"]["vllm"][0]).extras == {"cpu"}
    assert [Requirement(r).name for r in data["optional-dependencies"]["fsdp"]] == ["unirl-fsdp"]


def test_packaged_recipes_are_the_repository_recipes(tmp_path, monkeypatch):
    assert sorted(packaged_recipes()) == sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    assert PACKAGED_RECIPES.resolve() == (ROOT / "recipes").resolve()  # one copy in git: a link
    monkeypatch.chdir(tmp_path)  # no recipes/ here, as after `pip install`
    assert resolve_recipe("parity-tiny-embedded") == packaged_recipes()["parity-tiny-embedded"]
    assert resolve_recipe("parity-tiny.yaml") == packaged_recipes()["parity-tiny"]
    assert load_config("parity-tiny", []).actor.name == "fsdp"  # its extends chain resolves in the package
    with pytest.raises(ConfigError, match=r"recipes/arith-tiny.yaml does not exist; 'arith-tiny' is a packaged"):
        resolve_recipe("recipes/arith-tiny.yaml")  # a path is never swapped for a packaged file
    with pytest.raises(ConfigError, match="did you mean 'parity-tiny-embedded'"):
        resolve_recipe("parity-tiny-embeded")
    (tmp_path / "arith-tiny").write_text("run: {name: mine}\n")
    assert load_config("arith-tiny", []).run.name == "mine"  # a file wins over a packaged name


def test_recipes_copy_writes_the_extends_chain_and_keeps_user_edits(tmp_path, capsys):
    from unirl.outputs import record_output_file

    assert main(["recipes", "copy", "parity-tiny", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "arith-tiny.yaml", "parity-tiny-embedded.yaml", "parity-tiny.yaml"]
    assert load_config(str(tmp_path / "parity-tiny.yaml"), []).run.name == "parity-tiny"
    edited = tmp_path / "arith-tiny.yaml"
    edited.write_text(edited.read_text() + "# mine\n")
    capsys.readouterr()
    assert main(["recipes", "copy", "parity-tiny", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "arith-tiny.yaml already exists with other content that `unirl recipes copy` did not write" in err
    assert "another directory" in err
    with pytest.raises(ConfigError, match="did not write"):  # an edited copy is the user's: --force included
        copy_recipe("parity-tiny", tmp_path, force=True)
    assert edited.read_text().endswith("# mine\n")  # untouched
    edited.write_text("run: {name: an older packaged version}\n")
    record_output_file(edited, "recipe")  # an unedited copy UniRL wrote (of another version)
    with pytest.raises(ConfigError, match="earlier copy of another version.*--force"):
        copy_recipe("parity-tiny", tmp_path)
    assert copy_recipe("parity-tiny", tmp_path, force=True)[-1].read_text() == (ROOT / "recipes/arith-tiny.yaml").read_text()
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^parity-tiny-embedded +Bitwise train-inference parity on the embedded path", out, re.M)



def test_only_an_install_line_replaces_cores_unregistered_name():
    """A plugin's ``pip install`` fix for a selection field replaces core's "no ... named" line; any other
    complaint about that field keeps core's (which lists what exists)."""
    import types

    from unirl.kernel import Violation, hookimpl
    from unirl.preflight import preflight

    def plugin(fix: str):
        mod = types.ModuleType(f"extra_hint_{abs(hash(fix))}")

        @hookimpl
        def unirl_preflight(config):
            return [Violation("acme", "rollout.engine, actor.name", "needs acme's extra", fix)]

        mod.unirl_preflight = unirl_preflight
        return mod

    config = load_config(None, ["rollout.engine=warp", "actor.name=warp"])
    installs = preflight(config, load_kernel(extra=[("acme", plugin("pip install 'acme[warp]'"))]))
    assert [(v.source, v.field) for v in installs if v.field in ("rollout.engine", "actor.name")
            or v.source == "acme"] == [("acme", "rollout.engine, actor.name")]
    other = preflight(config, load_kernel(extra=[("acme", plugin("use torch"))]))
    fields = [(v.source, v.field) for v in other]
    assert ("unirl-core", "rollout.engine") in fields and ("unirl-core", "actor.name") in fields
    assert ("acme", "rollout.engine, actor.name") in fields
