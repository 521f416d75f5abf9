"""Every code reference in docs/ and the package READMEs resolves against the code, so a move fails a test.

Why: docs drift one refactor at a time. Issue 72 checked 10 references in two pages by hand and found 7
stale (``trainer/loop.py: build_components`` after the function had moved). Three forms are checked:

- a file path, ``trainer/loop.py`` (or ``../core/src/unirl/api.py``, relative to the page): some
  source file in the repository ends with it;
- a file and a name, ``trainer/step.py: train_on_batch``, ``vllm_side/moe.py:gather_experts`` or a test
  id ``core/tests/test_x.py::test_y`` (outside fenced code, where ``path.py: text`` is prose): the name
  is defined in that file (a ``def``, a ``class``, an assignment; ``Class.method`` inside its class);
- a dotted name, ``unirl.trainer.replay.old_logprobs_needed`` or ``unirl_vllm.engine``: the longest
  module prefix exists and the next name is bound in it (defined, imported, or exported through an
  ``_EXPORTS`` table such as ``unirl.api``'s);
- a class member, ```Kernel.walk``` or ```PythonSandbox.isolation```, where a class of that name is defined
  in some ``src/``: the member is defined in it (a method, a class attribute, a ``self.x =``), or in a base
  class defined here too (a class with a base from outside the repository is not judged).

The file index and the definitions are read with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: where source files live; build outputs, caches and the venv are not walked
SOURCE_DIRS = ("core", "plugins", "benchmarks", "scripts", "tests", "docs", "recipes")
SKIP_DIRS = {".venv", "__pycache__", "build", "dist", ".cache", "runs", ".git", "node_modules"}

#: paths named in the docs that are not this repository's: upstream files and the docs' worked examples
FOREIGN_PATHS = (
    "v1/", "layers/linear.py", "ops/topk_topp_sampler.py",  # vLLM's sources (docs/parity.md's patch table)
    "python/sglang/", "managers/tokenizer_manager.py", "io_struct.py",  # SGLang's (plugins/unirl-sglang)
    "src/unirl_length_reward/", "src/my_pkg/", "mods.py", "my_plugin.py",  # docs/writing-plugins.md's examples
)
#: dotted names that look like modules but are not: entry-point groups, a logger, a schema, examples
NOT_MODULES = (
    "unirl.plugins",  # the plugins' entry-point group
    "unirl_parity.vllm_adapters",  # the parity plugin's entry-point group for vLLM adapters
    "unirl.trackers",  # the trackers' logger
    "unirl.rollout_trace",  # the replay-trace manifest's schema name
    "unirl_length_reward",  # docs/writing-plugins.md's example plugin
)

#: a path, then maybe a name in the same code span: ``path.py: name`` (not ``path.py`: `name``, which
#: the docs also use for names merely used there, e.g. a hook's argument types)
PATH_RE = re.compile(r"(?<![\w/.-])((?:\.{1,2}/)*(?:[\w.-]+/)*[\w-]+\.py)(?:::? ?([A-Za-z_][\w.]*))?")
MEMBER_RE = re.compile(r"`([A-Z][A-Za-z0-9]+)\.([a-z_][a-z0-9_]*)[`(]")
DOTTED_RE = re.compile(r"(?<![\w./-])(unirl(?:_[a-z_]+)?(?:\.[A-Za-z_]\w*)+)")


def pages(root: Path = ROOT) -> list[Path]:
    return [*sorted((root / "docs").glob("*.md")), root / "README.md", root / "core" / "README.md",
            *sorted(root.glob("plugins/*/README.md")), *sorted(root.glob("docs/examples/*/README.md"))]


@functools.cache
def source_files(root: Path = ROOT) -> tuple[str, ...]:
    out = []
    for top in SOURCE_DIRS:
        stack = [root / top] if (root / top).is_dir() else []
        while stack:
            for p in stack.pop().iterdir():
                if p.is_dir():
                    if p.name not in SKIP_DIRS and not p.name.endswith(".egg-info"):
                        stack.append(p)
                elif p.suffix == ".py":
                    out.append(p.relative_to(root).as_posix())
    return tuple(sorted(out))


@functools.cache
def modules(root: Path = ROOT) -> dict[str, str]:
    """Dotted module name -> file, for every file under a ``src/`` directory."""
    out = {}
    for rel in source_files(root):
        parts = list(Path(rel).with_suffix("").parts)
        if "src" in parts:
            dotted = parts[parts.index("src") + 1:]
            if dotted[-1] == "__init__":
                dotted.pop()
            out[".".join(dotted)] = rel
    return out


@functools.cache
def defined(path: Path) -> frozenset[str]:
    """Names a file defines: top level, class members as ``Class.name``, module-level ``if``/``try`` too."""
    names: set[str] = set()

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(prefix + child.name)
                if isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                names.update(prefix + n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(child, ast.If | ast.Try | ast.With):
                walk(child, prefix)

    walk(ast.parse(path.read_text(), filename=str(path)), "")
    return frozenset(names)


@functools.cache
def bound(path: Path) -> frozenset[str]:
    """Names a module binds at any level: defined, imported, or exported through an ``_EXPORTS`` dict."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set(defined(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(getattr(t, "id", None) == "_EXPORTS" for t in targets):
                names.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
    return frozenset(names)


@functools.cache
def classes(root: Path = ROOT) -> dict[str, list[tuple[list[str | None], set[str]]]]:
    """Class name -> (base names, members) of each class of that name under a ``src/`` directory."""
    out: dict[str, list[tuple[list[str | None], set[str]]]] = {}
    for rel in source_files(root):
        if "/src/" not in rel:
            continue
        for node in ast.walk(ast.parse((root / rel).read_text(), filename=rel)):
            if not isinstance(node, ast.ClassDef):
                continue
            members = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
            for n in ast.walk(node):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
                for t in targets:
                    if isinstance(t, ast.Name) and n in node.body:
                        members.add(t.id)
                    elif isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self":
                        members.add(t.attr)
            bases = [getattr(b, "id", None) or getattr(b, "attr", None) for b in node.bases]
            out.setdefault(node.name, []).append((bases, members))
    return out


def has_member(cls: str, attr: str, root: Path, seen: frozenset[str] = frozenset()) -> bool | None:
    """True / False, or None where a base class is not this repository's (its members are unknown)."""
    known = classes(root)
    if cls not in known or cls in seen:
        return None
    verdict: bool | None = False
    for bases, members in known[cls]:
        if attr in members:
            return True
        for base in bases:
            if base in {"ABC", "object", "Protocol", "Generic", "Exception"}:
                continue
            found = has_member(base, attr, root, seen | {cls}) if base else None
            if found:
                return True
            if found is None:
                verdict = None
    return verdict


def check_path(page: Path, ref: str, name: str | None, root: Path) -> str | None:
    """Why ``ref`` (with ``name``, if given) does not resolve, or None."""
    if ref.startswith("."):
        ref = (page.parent / ref).resolve().relative_to(root.resolve()).as_posix()
    if any(ref.startswith(f) or ref == f for f in FOREIGN_PATHS):
        return None
    hits = [f for f in source_files(root) if f == ref or f.endswith("/" + ref)]
    if not hits:
        return f"{ref}: no such file"
    if name and not any(name in defined(root / h) for h in hits):
        return f"{ref}: {name}: not defined in {', '.join(hits)}"
    return None


def check_dotted(ref: str, root: Path) -> str | None:
    if any(ref == m or ref.startswith(m + ".") for m in NOT_MODULES):
        return None
    mods = modules(root)
    parts = ref.split(".")
    k = len(parts)
    while k and ".".join(parts[:k]) not in mods:
        k -= 1
    if not k:
        return f"{ref}: no such module"
    rest = parts[k:]
    if rest and rest[0] not in bound(root / mods[".".join(parts[:k])]):
        return f"{ref}: {rest[0]}: not in {'.'.join(parts[:k])} ({mods['.'.join(parts[:k])]})"
    return None


def stale_references(page: Path, root: Path = ROOT) -> list[str]:
    out, fenced = [], False
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        for m in PATH_RE.finditer(line):
            why = check_path(page, m.group(1), None if fenced else m.group(2), root)
            if why:
                out.append(f"{page.relative_to(root)}:{n}: {why}")
        for m in MEMBER_RE.finditer(line):
            if has_member(m.group(1), m.group(2), root) is False:
                out.append(f"{page.relative_to(root)}:{n}: {m.group(1)}.{m.group(2)}: no such member")
        for m in DOTTED_RE.finditer(line):
            why = check_dotted(m.group(1).rstrip("."), root)
            if why:
                out.append(f"{page.relative_to(root)}:{n}: {why}")
    return out


def test_docs_references_resolve():
    checked = pages()
    assert len(checked) > 25
    stale = [s for page in checked for s in stale_references(page)]
    assert not stale, "stale code references in the docs (fix the page, or the name if it moved):\n" \
        + "\n".join(stale)


def test_the_checker_finds_a_moved_name_a_missing_file_and_a_missing_module(tmp_path):
    """The oracle: a small tree where each kind of stale reference is planted next to a good one."""
    src = tmp_path / "core" / "src" / "pkg"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "loop.py").write_text("from pkg.other import moved\n\nclass Loop:\n    def run(self): ...\n")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text("`pkg/loop.py: Loop.run` and `pkg/loop.py: moved` and `pkg/gone.py`\n"
                    "```\npkg/loop.py: prose in a code block\n```\n"
                    "`unirl_x.loop` is not here; `Loop.run` and `Loop.ran`\n")
    (tmp_path / "core" / "src" / "unirl_x").mkdir()
    caches = (source_files, modules, classes)
    for c in caches:
        c.cache_clear()
    try:
        found = stale_references(page, tmp_path)
    finally:
        for c in caches:
            c.cache_clear()
    assert found == [
        "docs/page.md:1: pkg/loop.py: moved: not defined in core/src/pkg/loop.py",
        "docs/page.md:1: pkg/gone.py: no such file",
        "docs/page.md:5: Loop.ran: no such member",
        "docs/page.md:5: unirl_x.loop: no such module",
    ]


def test_core_module_map_names_every_top_level_module():
    """core/README.md's module map has a row naming each module and package directly under ``src/unirl/``,
    so a new or moved one shows up there (each name in the map resolves: the test above)."""
    page = (ROOT / "core" / "README.md").read_text()
    section = page.split("## Module map", 1)[1].split("\n## ", 1)[0]
    first_cells = " ".join(line.split("|")[1] for line in section.splitlines() if line.startswith("| `"))
    named = set(re.findall(r"`([\w]+(?:\.py|/))`", first_cells))
    src = ROOT / "core" / "src" / "unirl"
    tree = {p.name for p in src.glob("*.py")} | {f"{p.name}/" for p in src.iterdir()
                                                  if (p.is_dir() or p.is_symlink()) and p.name != "__pycache__"}
    assert len(tree) > 30
    assert tree - named == set(), "add a row to core/README.md's module map for these"
    assert named - tree == set(), "no longer in core/src/unirl/: drop them from core/README.md's module map"
