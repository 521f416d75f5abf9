"""Recipe files: reading one (with ``extends``), finding a packaged one by name, copying one out.

Why strict reading: PyYAML keeps the last of two equal keys, reads an empty file as nothing and a
non-UTF-8 one as a traceback; each is a recipe whose author believes it says something it does not.
Here a duplicate key, an empty or comment-only recipe, a file that is not UTF-8 and a directory in
place of a file are each one :class:`~unirl.kernel.errors.ConfigError` line naming the file, the line
and the fix. Every message is one line (the CLI prints it after ``error:``).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml

from unirl.kernel.errors import ConfigError


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping gives one key twice (PyYAML would silently keep the last)."""


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping, at any depth."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base`` merges, by YAML's own rule
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader's own error says so below
                continue
            if first is not None:
                raise DuplicateKeyError(None, None, f"duplicate key {key!r} (first given at line {first + 1}; YAML "
                                        "keeps only the last)", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error in one line: what is wrong and where (its own text spans several, with carets)."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def load_yaml(text: str) -> Any:
    """``text`` parsed like ``yaml.safe_load``, but a key given twice in one mapping is an error."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass


def _text(p: Path, path: str | Path) -> str:
    """The recipe's text; a file that is not UTF-8 is one line naming the first bad byte's line."""
    data = p.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(f"recipe {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at line {line}); fix: "
                          "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _is_directory(path: str | Path, what: str) -> ConfigError:
    """``what`` ends where the directory's name goes: "recipe", or "recipe a.yaml: 'extends: b' names"."""
    inside = sorted(f.name for f in Path(path).iterdir() if f.suffix in _SUFFIXES)[:3]
    hint = f"; it holds {', '.join(inside)}" if inside else ""
    return ConfigError(f"{what} {path}, which is a directory, not a recipe file{hint} (fix: name a YAML file)")


def read_recipe(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe as a dict. ``extends: other.yaml`` (relative to the recipe) is merged underneath, so a
    variant recipe states only what differs from its base."""
    p = Path(path)
    if p.is_dir():
        raise _is_directory(path, "recipe")
    if not p.is_file():
        raise ConfigError(f"recipe {path} does not exist")
    if p.resolve() in _seen:
        raise ConfigError(f"recipe {path}: 'extends' loops back to itself")
    try:
        loaded = load_yaml(_text(p, path))
    except DuplicateKeyError as exc:
        raise ConfigError(f"recipe {path}: {yaml_problem(exc)}; fix: give the key once (merge the two)") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {path} is not valid YAML: {yaml_problem(exc)}") from None
    if loaded is None:
        raise ConfigError(f"recipe {path} is empty (no settings, only blank lines or comments); fix: add the "
                          "sections to change, or 'extends: <base>.yaml', or run without a recipe for the defaults")
    if not isinstance(loaded, dict):
        raise ConfigError(f"recipe {path} must be a mapping of sections, got {type(loaded).__name__}")
    base = loaded.pop("extends", None)
    if base is None:
        return loaded
    if not isinstance(base, str):
        raise ConfigError(f"recipe {path}: 'extends' must be a file name, got {base!r}")
    target = p.parent / base
    if target.is_dir():
        raise _is_directory(target, f"recipe {path}: 'extends: {base}' names")
    if not target.is_file():
        raise ConfigError(f"recipe {path}: 'extends: {base}' names {target}, which does not exist; "
                          "fix: the path is relative to the recipe's own directory")
    return _deep_merge(read_recipe(target, (*_seen, p.resolve())), loaded)


#: The recipes that ship inside unirl-core. In a checkout ``src/unirl/recipes`` is a link to the
#: repository's ``recipes/`` (the one copy in git); a wheel holds the files themselves.
PACKAGED_RECIPES = Path(__file__).resolve().parent / "recipes"
_SUFFIXES = (".yaml", ".yml")


def packaged_recipes() -> dict[str, Path]:
    """``{name: path}`` of every packaged recipe (``unirl recipes`` lists them)."""
    if not PACKAGED_RECIPES.is_dir():
        return {}
    return {f.stem: f for f in sorted(PACKAGED_RECIPES.iterdir()) if f.suffix in _SUFFIXES and f.is_file()}


def resolve_recipe(path: str | Path) -> Path:
    """The recipe file ``path`` names: a file that exists, else a packaged recipe by its bare name
    (``parity-tiny-embedded`` or ``parity-tiny-embedded.yaml``).

    Why a name: a user who installed the wheels has no ``recipes/`` directory, and ``unirl train NAME``
    must still run. A file always wins over a packaged recipe of the same name, and a path with a
    directory in it is never replaced by a packaged recipe: that would silently train on a different
    file than the one the user named. A directory is called a directory, not "missing"."""
    p = Path(path)
    if p.is_file():
        return p
    if p.is_dir():
        raise _is_directory(path, "recipe")
    packaged = packaged_recipes()
    stem = p.name[: -len(p.suffix)] if p.suffix in _SUFFIXES else p.name
    bare = p.parent == Path(".") and not str(path).startswith(".")
    if bare and stem in packaged:
        return packaged[stem]
    if stem in packaged:
        raise ConfigError(f"recipe {path} does not exist; '{stem}' is a packaged recipe (fix: give the bare name "
                          f"{stem} to use the packaged one, or `unirl recipes copy {stem}` to write it here and edit it)")
    near = difflib.get_close_matches(stem, list(packaged), n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    what = "does not exist" if not bare else "does not exist and is not a packaged recipe"
    raise ConfigError(f"recipe {path} {what}{hint} (fix: give the path of a YAML recipe, or one of the names "
                      "`unirl recipes` lists)")


def recipe_summary(path: Path) -> str:
    """The first line of a recipe's leading comment (what ``unirl recipes`` shows beside its name)."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def copy_recipe(name: str, dest: str | Path = ".", *, force: bool = False) -> list[Path]:
    """Write the packaged recipe ``name`` into ``dest`` for the user to edit; returns the files written.

    The recipes it ``extends`` are written beside it, because ``extends`` is relative to the recipe's own
    directory: a copy without its base would not load. Each file written is noted (:mod:`unirl.outputs`) so a
    later copy knows it: a file with other content that UniRL did not write, or that the user has edited since,
    is never replaced, ``force`` included; an unedited earlier copy is replaced only with ``force``."""
    packaged = packaged_recipes()
    stem = name[: -len(Path(name).suffix)] if Path(name).suffix in _SUFFIXES else name
    if stem not in packaged:
        near = difflib.get_close_matches(stem, list(packaged), n=1)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        raise ConfigError(f"no packaged recipe named '{name}'{hint} (fix: one of the names `unirl recipes` lists)")
    chain: list[Path] = []
    src: Path | None = packaged[stem]
    while src is not None and src not in chain:
        chain.append(src)
        base = (load_yaml(src.read_text()) or {}).get("extends")
        src = src.parent / base if isinstance(base, str) else None
    from unirl.outputs import file_is_ours, record_output_file

    out = Path(dest)
    clash = [out / f.name for f in chain
             if (out / f.name).exists() and (out / f.name).read_bytes() != f.read_bytes()]
    theirs = [p for p in clash if not file_is_ours(p, "recipe")]
    if theirs:  # never destroy what UniRL did not write (an edited copy is the user's again), --force included
        raise ConfigError(f"{', '.join(map(str, theirs))} already exist{'s' if len(theirs) == 1 else ''} with other "
                          "content that `unirl recipes copy` did not write (maybe your edits), so nothing was written "
                          "(fix: another directory, or move those files away)")
    if clash and not force:
        raise ConfigError(f"{', '.join(map(str, clash))} hold{'s' if len(clash) == 1 else ''} an earlier copy of "
                          "another version, so nothing was written (fix: --force to replace these unedited copies, "
                          "or another directory)")
    out.mkdir(parents=True, exist_ok=True)
    for f in chain:
        (out / f.name).write_bytes(f.read_bytes())
        record_output_file(out / f.name, "recipe")
    return [out / f.name for f in chain]
