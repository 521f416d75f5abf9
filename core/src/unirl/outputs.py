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
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from unirl.fsio import swap_dir
from unirl.kernel.errors import ConfigError

#: written into every directory UniRL exports, so a later export may replace it
MARKER = "unirl-output.json"


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
    if force or not path.exists():
        return path
    if not path.is_dir():
        raise OutputExistsError(f"{field} {path}: is a file, not a directory; it is left untouched "
                                f"(fix: choose another path{_or_force(force_flag)})")
    if not any(path.iterdir()) or dir_is_ours(path, kind):
        return path
    raise OutputExistsError(f"{field} {path}: the directory holds files UniRL did not write (no {MARKER} naming "
                            f"it an earlier {kind}); they are left untouched (fix: choose an empty or new directory"
                            f"{_or_force(force_flag, ' to replace its contents')})")


def mark_output_dir(path: str | Path, kind: str, **info: object) -> None:
    """Write the :data:`MARKER` into ``path`` (a staged directory, before it is swapped into place)."""
    (Path(path) / MARKER).write_text(json.dumps({"kind": kind, **info}, sort_keys=True) + "\n")


def claim_output_file(path: str | Path, *, field: str, is_ours: Callable[[Path], bool], what: str,
                      force: bool = False, force_flag: str | None = "--force") -> Path:
    """Refuse (``OutputExistsError``) an existing ``path`` that ``is_ours`` does not recognise as an
    earlier ``what``, unless ``force``. A directory is always refused."""
    path = Path(path)
    _check_parent(path, field)
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


def replace_output_dir(staged: str | Path, path: str | Path, *, kind: str, field: str,
                       force: bool = False) -> Path:
    """Move the finished directory ``staged`` (a sibling of ``path``, marked with :func:`mark_output_dir`)
    to ``path``. The claim is checked again first: minutes may have passed since the first one, and a
    file that appeared meanwhile is the user's. What ``path`` held (empty, an earlier ``kind`` output, or
    anything when ``force``) is removed only after ``staged`` is in place."""
    staged, path = Path(staged), Path(path)
    try:
        claim_output_dir(path, kind=kind, field=field, force=force)
    except OutputExistsError:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if path.exists() and not path.is_dir():  # --force over a file: a directory takes its place
        path.unlink()
    if not path.exists():
        os.replace(staged, path)
        return path
    return swap_dir(staged, path)


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
