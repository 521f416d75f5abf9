"""User-named output paths: what a command may replace, and what it must refuse.

Why one rule: ``unirl export --out DIR`` used to swap its staged directory over whatever ``DIR`` held,
and so deleted a user's files. Every command that writes a path the user names (``--out``,
``run.output_dir``, trace and parity reports) goes through here, and the rule is the same everywhere:

* a **directory** output is replaced only when it is absent, empty, or an earlier output of the same
  command (it holds the :data:`MARKER` file this module writes);
* a **file** output is replaced only when it is absent or recognisably an earlier output of the same
  command (the caller says what its outputs look like: ``is_ours``);
* anything else is refused before any work starts, with the path and the fix (another path, or
  ``--force`` where the command offers it).

``--force`` still removes only UniRL's own files: over a directory it writes beside the user's files
(they stay byte for byte; one that has the name of a file the command writes is refused), never over a
file UniRL did not write that sits where a directory goes. The marker lists the files the output holds,
so a later output replaces exactly those and keeps whatever the user added since. A single file the
user names explicitly (``eval --out FILE --force``) is the one exception: naming it is the consent.

Files written into a user's directory (``unirl agentic-data``'s ``data.source``) cannot carry a marker
inside them: :func:`record_output_file` notes each in :data:`FILES_MARKER` beside it with its sha256, so
it is recognised as UniRL's only while it holds exactly what UniRL wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from unirl.fsio import atomic_write_json, swap_dir
from unirl.kernel.errors import ConfigError
from unirl.writable import check_writable

#: written into every directory UniRL exports, so a later export may replace it
MARKER = "unirl-output.json"
#: beside files UniRL writes into a directory that is not its own: ``{name: {kind, sha256}}``
FILES_MARKER = ".unirl-outputs.json"


class OutputExistsError(ConfigError):
    """A user-named output path holds something UniRL did not write; nothing was touched."""


def dir_is_ours(path: Path, kind: str) -> bool:
    """True when ``path`` holds the :data:`MARKER` of an earlier ``kind`` output."""
    try:
        return json.loads((path / MARKER).read_text()).get("kind") == kind
    except (OSError, ValueError, AttributeError):
        return False


def claim_output_dir(path: str | Path, *, kind: str, field: str, force: bool = False,
                     force_flag: str | None = "--force") -> Path:
    """Refuse (``OutputExistsError``) a ``path`` that exists and is neither an empty directory nor an
    earlier ``kind`` output, unless ``force``. Call it before any expensive work."""
    path = Path(path)
    _check_parent(path, field)
    check_writable(path, field, "choose a directory on a writable disk")
    if not path.exists():
        return path
    if not path.is_dir():
        raise OutputExistsError(f"{field} {path}: is a file, not a directory; it is left untouched, --force "
                                "included (fix: choose another path)")
    if force or not any(path.iterdir()) or dir_is_ours(path, kind):
        return path
    raise OutputExistsError(f"{field} {path}: the directory holds files UniRL did not write (no {MARKER} naming "
                            f"it an earlier {kind}); they are left untouched (fix: choose an empty or new directory"
                            f"{_or_force(force_flag, ' to write beside them; they are kept')})")


def mark_output_dir(path: str | Path, kind: str, **info: object) -> None:
    """Write the :data:`MARKER` into ``path`` (a staged directory, before it is swapped into place),
    listing the files it holds: what a later output of ``kind`` may replace."""
    files = sorted(p.name for p in Path(path).iterdir() if p.name != MARKER)
    (Path(path) / MARKER).write_text(json.dumps({"kind": kind, "files": files, **info}, sort_keys=True) + "\n")


def owned_names(path: Path, kind: str) -> set[str]:
    """The entries of ``path`` an earlier ``kind`` output wrote (its marker's ``files``; a marker from
    before the list existed owns the whole directory); empty when ``path`` is not such an output."""
    if not dir_is_ours(path, kind):
        return set()
    files = json.loads((path / MARKER).read_text()).get("files")
    names = {p.name for p in path.iterdir()}
    return (names if not isinstance(files, list) else names & {str(f) for f in files}) | {MARKER}


def claim_output_file(path: str | Path, *, field: str, is_ours: Callable[[Path], bool], what: str,
                      force: bool = False, force_flag: str | None = "--force") -> Path:
    """Refuse (``OutputExistsError``) an existing ``path`` that ``is_ours`` does not recognise as an
    earlier ``what``, unless ``force``. A directory is always refused."""
    path = Path(path)
    _check_parent(path, field)
    check_writable(path, field, "choose a path on a writable disk")
    if not path.exists():
        return path
    if path.is_dir():
        raise OutputExistsError(f"{field} {path}: is a directory; a {what} is a file "
                                "(fix: name a file path, e.g. inside that directory)")
    if force:
        return path
    try:
        ours = is_ours(path)
    except (OSError, ValueError):
        ours = False
    if ours:
        return path
    raise OutputExistsError(f"{field} {path}: the file exists and is not a {what} UniRL wrote; it is left "
                            f"untouched (fix: choose another path{_or_force(force_flag, ' to overwrite it')})")


def replace_output_dir(staged: str | Path, path: str | Path, *, kind: str, field: str, force: bool = False,
                       force_flag: str | None = "--force") -> Path:
    """Move the finished directory ``staged`` (a sibling of ``path``, marked with :func:`mark_output_dir`)
    to ``path``. The claim is checked again first: minutes may have passed since the first one, and a
    file that appeared meanwhile is the user's. Only UniRL's own files in ``path`` are replaced: when it
    holds nothing else the whole directory is swapped atomically; otherwise (``force``, or files the user
    added to an earlier output) the new files are moved in one by one beside the user's, which stay."""
    staged, path = Path(staged), Path(path)
    try:
        claim_output_dir(path, kind=kind, field=field, force=force, force_flag=force_flag)
        if not path.exists():
            os.replace(staged, path)
            return path
        owned = owned_names(path, kind)
        users = {p.name for p in path.iterdir()} - owned
        if not users:
            return swap_dir(staged, path)
        new = {p.name for p in staged.iterdir()}
        clash = sorted(users & new)
        if clash:
            raise OutputExistsError(f"{field} {path}: {path / clash[0]} is not a file UniRL wrote and has the name "
                                    f"of one it writes; it is left untouched, --force included (fix: move it away, "
                                    "or choose an empty or new directory)")
    except OutputExistsError:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    for name in owned - new:
        _remove(path / name)
    for name in sorted(new - {MARKER}) + [MARKER]:  # the marker last: it lists what is in place
        if (path / name).is_dir() and not (path / name).is_symlink():
            _remove(path / name)
        os.replace(staged / name, path / name)
    staged.rmdir()
    return path


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def record_output_file(path: str | Path, kind: str) -> None:
    """Note ``path`` (just written) in :data:`FILES_MARKER` beside it as a ``kind`` output with its sha256."""
    path = Path(path)
    book = path.parent / FILES_MARKER
    try:
        entries = json.loads(book.read_text())
    except (OSError, ValueError):
        entries = {}
    entries = entries if isinstance(entries, dict) else {}
    entries[path.name] = {"kind": kind, "sha256": _sha256(path)}
    atomic_write_json(book, entries, indent=1, sort_keys=True)


def file_is_ours(path: str | Path, kind: str) -> bool:
    """``path`` is a ``kind`` output :func:`record_output_file` noted and nobody has changed since."""
    path = Path(path)
    try:
        entry = json.loads((path.parent / FILES_MARKER).read_text()).get(path.name)
        return entry.get("kind") == kind and entry.get("sha256") == _sha256(path)
    except (OSError, ValueError, AttributeError):
        return False


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_parent(path: Path, field: str) -> None:
    """The nearest existing ancestor must be a directory, or the write fails late with an OSError."""
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise OutputExistsError(f"{field} {path}: {parent} is a file, not a directory "
                                        "(fix: choose a path under a directory)")
            return


def _or_force(flag: str | None, why: str = "") -> str:
    return f", or pass {flag}{why}" if flag else ""


def main(argv: list[str] | None = None) -> int:
    """``python -m unirl.outputs claim DIR KIND FIELD`` / ``replace STAGED DIR KIND FIELD``: the same rule
    for a build step outside Python (``make dist DIST_DIR=...``); an error is one line, exit 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if len(args) == 4 and args[0] == "claim":
            claim_output_dir(args[1], kind=args[2], field=args[3], force_flag=None)
        elif len(args) == 5 and args[0] == "replace":
            mark_output_dir(args[1], args[3])
            replace_output_dir(args[1], args[2], kind=args[3], field=args[4], force_flag=None)
        else:
            print("usage: python -m unirl.outputs claim DIR KIND FIELD | replace STAGED DIR KIND FIELD", file=sys.stderr)
            return 2
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
