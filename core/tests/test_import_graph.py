"""Core's module import graph has no cycle and no upward edge, and no plugin's graph has a cycle.

Why: a cycle hidden in a function-level import works until someone moves that import to the top (or
imports the other module first), then fails with a half-initialised module. An upward edge (the runtime
reaching into preflight) makes a low layer pull in everything above it. The graph is built with ``ast``
from every import, function-level ones included; imports under ``if TYPE_CHECKING:`` are types only
and are left out, and so is a module's import of its own ancestor packages (Python runs those first
anyway).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE_SRC = ROOT / "core" / "src"

#: core's layers, lowest first: a module may import its own layer and the layers below, never above.
#: Keyed by the first name under ``unirl`` (``unirl.rewards.judge`` -> ``rewards``; the package itself is ``unirl``).
LAYERS: list[tuple[str, set[str]]] = [
    ("kernel", {"unirl", "kernel", "fsio", "allocator", "memory", "config_bounds", "config_stream", "config_diagnostics", "writable", "outputs"}),
    ("foundation", {"config", "recipe_files", "samples", "sample_parts", "contracts", "declared", "weights", "packing", "placement", "models", "data", "logprobs",
                    "sample_rows", "memory_plan", "routing", "multimodal"}),
    ("components", {"algorithms", "runtime", "engine", "sync", "actor", "rollout", "rewards", "mismatch"}),
    ("checks", {"preflight", "inert", "plugin_sections"}),
    ("run", {"trainer", "export", "evaluation"}),
    ("entry", {"cli", "builtins", "api", "recipes", "testing"}),
]
def modules(src: Path) -> dict[str, Path]:
    out = {}
    for f in sorted(src.rglob("*.py")):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (getattr(node.test, "id", None) == "TYPE_CHECKING"
                                         or getattr(node.test, "attr", None) == "TYPE_CHECKING"):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports anywhere (functions included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_nodes(tree)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])]) \
                if node.level else node.module
            subs = {f"{base}.{a.name}" for a in node.names} & known.keys()
            out |= subs or {base}  # ``from pkg import submodule`` imports the submodule
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return {m for m in out if m in known and m != name and m not in ancestors}


def graph(src: Path) -> dict[str, set[str]]:
    known = modules(src)
    return {name: imported(name, path, known) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def describe(g: dict[str, set[str]], comp: list[str]) -> str:
    return "\n".join(f"  {a} -> {', '.join(sorted(g[a] & set(comp)))}" for a in comp)


def layer_of(module: str) -> int:
    key = module.split(".")[1] if "." in module else module
    for i, (_, names) in enumerate(LAYERS):
        if key in names:
            return i
    raise AssertionError(f"{module}: '{key}' is in no layer of {__name__}.LAYERS; add it to the right one")


def test_core_has_no_import_cycle():
    g = graph(CORE_SRC)
    assert len(g) > 50 and "unirl.rewards.judge" in g
    found = cycles(g)
    assert not found, "import cycles in core:\n" + "\n\n".join(describe(g, c) for c in found)


def test_no_core_module_imports_upward():
    g = graph(CORE_SRC)
    bad = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
           for a in sorted(g) for b in sorted(g[a]) if layer_of(b) > layer_of(a)]
    assert not bad, "upward imports (layers, lowest first: " + " < ".join(n for n, _ in LAYERS) + "):\n" \
        + "\n".join(bad)


@pytest.mark.parametrize("src", sorted(ROOT.glob("plugins/*/src")), ids=lambda p: p.parent.name)
def test_plugin_has_no_import_cycle(src: Path):
    g = graph(src)
    found = cycles(g)
    assert not found, f"import cycles in {src.parent.name}:\n" + "\n\n".join(describe(g, c) for c in found)


def test_the_walker_sees_function_level_imports_and_skips_type_checking(tmp_path):
    """The check itself: a cycle through a function-level import is found; a TYPE_CHECKING one is not."""
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from p import b\n")
    (pkg / "b.py").write_text("def f():\n    from p.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import a\nimport p.b\n")
    g = graph(tmp_path)
    assert cycles(g) == [["p.a", "p.b"]]
    assert g["p.c"] == {"p.b"}
