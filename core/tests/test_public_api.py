"""The public API is declared in one place (``unirl.api``) and plugins use nothing else of core.

Why a test: the rule "a plugin imports only core's public API" is only real if a change that breaks it
goes red. The check parses every plugin's ``src/`` (and the example third-party plugin) with ``ast``, so
it sees lazy imports inside functions too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import unirl.api as api

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_SOURCES = sorted(p for p in [*ROOT.glob("plugins/*/src"), *ROOT.glob("docs/examples/*/src")] if p.is_dir())


def core_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a ``unirl`` module (not ``unirl_*`` plugin packages)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [node.module]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        else:
            continue
        out += [(node.lineno, m) for m in mods if m == "unirl" or m.startswith("unirl.")]
    return out


def test_there_are_plugins_to_check():
    assert len(PLUGIN_SOURCES) >= 4, PLUGIN_SOURCES


@pytest.mark.parametrize("src", PLUGIN_SOURCES, ids=lambda p: p.parent.name)
def test_plugins_import_core_only_through_unirl_api(src: Path):
    bad = [f"{f.relative_to(ROOT)}:{line}: imports {mod}"
           for f in sorted(src.rglob("*.py")) for line, mod in core_imports(f) if mod != "unirl.api"]
    assert not bad, "plugins import core only through unirl.api:\n" + "\n".join(bad)


def test_plugin_tests_drive_the_loop_through_unirl_api():
    """A plugin's tests show its authors how to run it: they train through ``unirl.api.train``, and
    import a name from a core module only when ``unirl.api`` does not export it (white-box tests of the
    embedded actor, or a monkeypatched ``build_components`` proving no model was built, stay)."""
    tests = sorted(f for d in ROOT.glob("plugins/*/tests") for f in d.rglob("*.py"))
    assert tests
    exported = set(api.__all__)
    redundant = []
    for f in tests:
        for node in ast.walk(ast.parse(f.read_text())):
            if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.startswith("unirl.") and node.module != "unirl.api"
                    and all(a.name in exported for a in node.names)):
                redundant.append(f"{f.relative_to(ROOT)}:{node.lineno}: from {node.module} import "
                                 + ", ".join(a.name for a in node.names))
    assert not redundant, "these names are in unirl.api; import them from there:\n" + "\n".join(redundant)


def test_every_public_name_resolves():
    for name in api.__all__:
        assert getattr(api, name) is not None, name


def test_unknown_name_says_where_to_look():
    with pytest.raises(AttributeError, match="__all__"):
        api.NoSuchThing  # noqa: B018


def test_importing_the_api_stays_cheap():
    """``from unirl.api import hookimpl`` is what every plugin module runs at discovery time."""
    code = "import sys; from unirl.api import hookimpl, Violation, RunConfig; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_stall_timeouts_types_are_public():
    """A third-party engine reports progress and a controller catches a stall through unirl.api (issue 68)."""
    from unirl.contracts.engine import EngineProgress
    from unirl.rollout.stall import EngineStalledError

    assert api.EngineProgress is EngineProgress and api.EngineStalledError is EngineStalledError
    assert issubclass(api.EngineStalledError, api.WorkerLostError)  # restartable (run.max_restarts)
    assert {"EngineProgress", "EngineStalledError"} <= set(api.__all__)
