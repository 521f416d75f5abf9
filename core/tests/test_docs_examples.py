"""Every fenced Python block in the docs and the package READMEs compiles and imports core only
through ``unirl.api``, and every name it imports from ``unirl.api`` exists.

Why: a third party writes a plugin by copying these blocks, and ``test_public_api.py`` fails any plugin
whose ``src/`` imports another ``unirl`` module. A block that teaches ``from unirl.kernel import ...``
(or a name ``unirl.api`` lacks) would make the guide teach a broken plugin.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import unirl.api as api

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([*ROOT.glob("docs/*.md"), *ROOT.glob("README.md"), *ROOT.glob("core/README.md"),
               *ROOT.glob("plugins/*/README.md"), *ROOT.glob("docs/examples/*/README.md")])
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```", re.S | re.M)


def blocks(path: Path) -> list[tuple[int, str]]:
    """(first line, code) of each fenced ``python`` block."""
    text = path.read_text()
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in FENCE.finditer(text)]


def core_imports(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) of each import of ``unirl`` or ``unirl.*`` (plugins' ``unirl_*`` are theirs)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
    return [(ln, m, names) for ln, m, names in out if m == "unirl" or m.startswith("unirl.")]


def test_the_plugin_guide_has_blocks_to_check():
    assert len(blocks(ROOT / "docs" / "writing-plugins.md")) >= 15


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_compile_and_import_only_unirl_api(path: Path):
    bad = []
    for start, code in blocks(path):
        where = f"{path.relative_to(ROOT)}:{start}"
        try:
            tree = ast.parse(code, filename=where)
            compile(tree, where, "exec")
        except SyntaxError as exc:
            bad.append(f"{where}: does not compile: {exc}")
            continue
        for line, module, names in core_imports(tree):
            if module != "unirl.api":
                bad.append(f"{path.relative_to(ROOT)}:{start + line - 1}: imports {module}; plugins import "
                           "core only through unirl.api")
            missing = [n for n in names if n != "*" and n not in api.__all__]
            if missing:
                bad.append(f"{path.relative_to(ROOT)}:{start + line - 1}: unirl.api has no {', '.join(missing)}")
    assert not bad, "\n".join(bad)


def test_the_check_catches_an_internal_import(tmp_path):
    """The check itself: a block importing ``unirl.kernel`` is reported (so a green run means something)."""
    doc = tmp_path / "x.md"
    doc.write_text("text\n\n```python\nfrom unirl.kernel import hookimpl\n```\n")
    (start, code), = blocks(doc)
    assert start == 4 and [m for _, m, _ in core_imports(ast.parse(code))] == ["unirl.kernel"]
