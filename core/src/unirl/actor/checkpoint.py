"""Atomic training checkpoints: a crash at any point leaves the previous checkpoint whole and loadable.

Layout of one checkpoint directory (e.g. ``runs/x/checkpoints/step_000010``)::

    model.safetensors       model weights (safetensors ``save_model``: tied weights stored once)
    adapter.safetensors     instead of model.safetensors with ``actor.lora``: the LoRA adapter only
                            (reference_adapter.safetensors likewise for the reference); the base is
                            rebuilt from the recipe, see :mod:`unirl.actor.lora`
    value_head.safetensors  optional value head
    reference.safetensors   optional frozen reference policy (KL penalty)
    optim.pt                optimizer + scheduler state dicts, plus any extra ``stateful`` objects
    rng.pt                  torch (CPU + CUDA), python ``random`` and numpy RNG states
    extra.pt                the caller's ``extra`` dict (trainer: data cursor, step, version ledger)
    meta.json               written last inside the temp dir: format version and file list

Protocol: everything is written into ``<dir>.tmp-<pid>``, each file fsynced, then
:func:`atomic_replace_dir` swaps it into place (temp dir fsynced, an existing ``<dir>`` moved aside to
``<dir>.old-<pid>`` and deleted after, the parent fsynced), and only then the parent's ``latest``
pointer (a one-line file naming the directory) is rewritten atomically (temp file + fsync +
``os.replace``). Readers follow ``latest``; a half-written ``*.tmp-*`` directory is never named by it,
and is removed by the next save.

:func:`atomic_replace_dir` and :func:`staging_dir` are the one directory-swap protocol of the project:
every actor's checkpoints and HF exports use them (and engines writing directories may too).

Retention (:func:`prune_checkpoints`, driven by ``trainer.keep_last`` / ``trainer.keep_every``) runs only
after a new checkpoint is committed and ``latest`` names it. It deletes oldest first, one directory at a
time, each first renamed to ``.prune-<name>-<pid>`` (no longer a checkpoint) and then removed, so a kill
mid-prune leaves every checkpoint retention promised whole; :func:`clean_checkpoint_root` (run on
resume) removes the ``.prune-*`` leftovers and the ``*.tmp-*`` / ``*.old-*`` of crashed saves.

Phases: the save, swap, commit and prune code calls :func:`checkpoint_phase` at each named point (a
*phase*; labels in :data:`PHASES`), and so may an actor that writes its own checkpoints. A phase calls
the one callback installed with :func:`set_phase_callback`, or nothing. Why a callback and not an
environment variable: fault drills (``core/tests/test_soak.py`` SIGKILLs a run at exactly one phase,
``core/tests/checkpoint_drill.py``) install their own, so no production code holds test logic or reads
a test variable, and a real run pays one ``None`` check per phase.

Checkpoints are trusted local files: ``torch.load(weights_only=False)`` reads the pickled RNG / extra.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from unirl.actor.checkpoint_files import (  # noqa: F401 - re-exported: the layout's names
    ADAPTER_FILE,
    CHECKPOINT_EXTRA_FILE,
    CHECKPOINT_META_FILE,
    EXTRA_FILE,
    FORMAT,
    LATEST,
    META_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    PRUNE_PREFIX,
    REFERENCE_ADAPTER_FILE,
    REFERENCE_FILE,
    RNG_FILE,
    VALUE_HEAD_FILE,
)
from unirl.actor.checkpoint_files import STEP_DIR as _STEP_DIR
from unirl.actor.checkpoint_health import checkpoint_problem  # noqa: F401 - re-exported
from unirl.fsio import as_os_errors, atomic_write, fsync_dir, fsync_file, swap_dir  # fsync_*: re-exported
from unirl.kernel.errors import UniRLError

#: the phase labels (``<name>`` is the checkpoint directory's name, e.g. ``step_000007``)
PHASES = (
    "save:<name>:begin",        # save_checkpoint entered; nothing written yet
    "save:<name>:<file>",       # one file of the staged checkpoint written and fsynced
    "swap:<name>",              # re-save: the old <name> moved aside to <name>.old-<pid>, new one not in yet
    "commit:<name>",            # <name> renamed into place, `latest` not moved yet
    "prune:<name>",             # <name> renamed to .prune-<name>-<pid>, not deleted yet
)


PhaseCallback = Callable[[str], None]
_phase_callback: PhaseCallback | None = None


def set_phase_callback(callback: PhaseCallback | None) -> PhaseCallback | None:
    """Install the one callback every :func:`checkpoint_phase` calls (``None`` removes it); returns the
    previous one, so a test can restore it. Process-wide: a drill that must act in Ray ranks installs
    it there too (e.g. when its plugin module is imported)."""
    global _phase_callback
    previous, _phase_callback = _phase_callback, callback
    return previous


def checkpoint_phase(label: str) -> None:
    """A named point of a save or a prune (see :data:`PHASES`); actors and tests add their own labels
    (e.g. ``train:<name>:update<u>``). Calls the installed phase callback, if any, with ``label``."""
    callback = _phase_callback
    if callback is not None:
        callback(label)


# ------------------------------------------------------------------------------------------ helpers


class CheckpointError(UniRLError, ValueError):
    """A checkpoint cannot be restored into this actor; the message names the directory, the field that
    differs and the fix."""


class CheckpointNotFoundError(UniRLError, FileNotFoundError):
    """No checkpoint where one was asked for (``run.resume`` / ``load(path)``)."""


def atomic_replace_dir(tmp: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Move the finished directory ``tmp`` to ``dest`` atomically; return ``dest``: the project's one
    directory swap (:func:`unirl.fsio.swap_dir`), with the ``swap:<name>`` phase between its renames. A
    process killed there leaves ``<dest>.old-<pid>``, which :func:`latest_checkpoint` reads and
    :func:`clean_stale` restores."""
    name = Path(dest).name
    return swap_dir(tmp, dest, between=lambda: checkpoint_phase(f"swap:{name}"))


def staging_tmp(dest: Path) -> Path:
    """The temp directory a write of ``dest`` is staged in (a sibling, so the rename is atomic)."""
    return dest.parent / f"{dest.name}.tmp-{os.getpid()}"


@contextlib.contextmanager
def staging_dir(dest: str | os.PathLike) -> Iterator[Path]:
    """Write a directory atomically: yield an empty temp sibling of ``dest``; on a clean exit it
    replaces ``dest`` (:func:`atomic_replace_dir`), on an error it is removed and ``dest`` is untouched."""
    dest = Path(dest).absolute()
    dest.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(dest)
    tmp = staging_tmp(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        atomic_replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_module(module: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import save_model

    with as_os_errors(path):  # a full disk, reported as the OSError guarded_write handles
        save_model(module, str(path))


def _read_module(module: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import load_model

    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    load_model(module, str(path), strict=True, device=str(device))


def adapter_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """The adapter's tensors (peft's ``get_peft_model_state_dict``: the names ``save_pretrained`` writes),
    detached contiguous copies, so they can be written while training goes on."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().contiguous().clone() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: torch.nn.Module, state: Mapping[str, Tensor], where: str) -> None:
    """Load ``state`` (from :func:`adapter_state`) into peft ``model``; every key and shape must match, or
    the error names ``where`` and the ``actor.lora`` field that differs."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    want = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}  # shapes only: no copies
    check_adapter_shapes(want, {k: tuple(v.shape) for k, v in state.items()}, where)
    set_peft_model_state_dict(model, dict(state), adapter_name="default")  # unirl.actor.lora.ADAPTER


def check_adapter_shapes(want: Mapping[str, Sequence[int]], have: Mapping[str, Sequence[int]], where: str) -> None:
    """The adapter tensors this actor has (``want``, name -> shape) against a checkpoint's (``have``): other
    names mean other target modules, other shapes another rank; the error names ``where`` and the
    ``actor.lora`` field to set."""
    want = {k: tuple(v) for k, v in want.items()}
    have = {k: tuple(v) for k, v in have.items()}
    if set(want) != set(have):
        extra, missing = sorted(set(have) - set(want)), sorted(set(want) - set(have))
        raise CheckpointError(f"{where}: the adapter was trained on other modules ({len(missing)} missing here, "
                              f"e.g. {missing[:2]}; {len(extra)} not here, e.g. {extra[:2]}) (fix: set "
                              "actor.lora.target_modules to what the checkpoint was trained with)")
    bad = sorted(k for k in want if want[k] != have[k])
    if bad:
        raise CheckpointError(f"{where}: {bad[0]} is {have[bad[0]]} in the checkpoint, {want[bad[0]]} here (fix: "
                              "set actor.lora.r to the rank the checkpoint was trained with)")


def check_checkpoint_kind(path: str | os.PathLike, *, adapter_only: bool, holds_adapter: bool) -> None:
    """A LoRA run (``adapter_only``) loads only adapter checkpoints, a full fine-tune only full ones; the
    error names ``actor.lora`` and the fix."""
    if adapter_only and not holds_adapter:
        raise CheckpointError(f"checkpoint {path} holds full weights, not a LoRA adapter, but actor.lora is set "
                              "(fix: unset actor.lora to resume it; a LoRA run starts from a base model.path)")
    if not adapter_only and holds_adapter:
        raise CheckpointError(f"checkpoint {path} holds only a LoRA adapter, but actor.lora is not set (fix: set "
                              "actor.lora as the run that wrote it did; its config.yaml has it)")


def _write_adapter(model: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import save_file

    with as_os_errors(path):
        save_file(adapter_state(model), str(path))


def _read_adapter(model: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import load_file

    load_adapter_state(model, load_file(str(path)), f"checkpoint {path.parent}")


def _write_torch(obj: Any, path: Path) -> None:
    with as_os_errors(path):  # torch.save reports a full disk as RuntimeError, with no errno
        torch.save(obj, path)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def write_meta(tmp: Path, meta: Mapping[str, Any]) -> None:
    """``meta.json``, written last into a staged checkpoint (its presence marks the checkpoint whole)."""
    atomic_write(tmp / META_FILE, json.dumps(dict(meta)))


def write_pointer(root: Path, name: str) -> None:
    """Point ``root/latest`` at ``name``, atomically and durably (:func:`unirl.fsio.atomic_write`)."""
    atomic_write(root / LATEST, name + "\n")


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint directory ``root/latest`` names, or None when there is none (or it is gone)."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if (path / META_FILE).is_file():
        return path
    # a crash between moving an overwritten checkpoint aside and renaming its successor into place
    for old in sorted(root.glob(f"{name}.old-*")):
        if (old / META_FILE).is_file():
            return old
    return None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself when it is a checkpoint, else the one its ``latest`` pointer names."""
    path = Path(path)
    if (path / META_FILE).is_file():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointNotFoundError(
            f"no checkpoint at {path} (no {META_FILE}, no valid '{LATEST}' pointer): check run.resume / "
            "the path given to load(); a checkpoint directory holds meta.json, its parent a 'latest' file")
    return found


def clean_stale(dest: Path) -> None:
    """Remove leftovers of a crashed save; restore a moved-aside checkpoint if the crash lost ``dest``."""
    for p in dest.parent.glob(f"{dest.name}.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in sorted(dest.parent.glob(f"{dest.name}.old-*")):
        if not dest.exists() and (p / META_FILE).is_file():
            os.replace(p, dest)
        else:
            shutil.rmtree(p, ignore_errors=True)


# ------------------------------------------------------------------------------------------ retention


def checkpoint_steps(root: str | os.PathLike) -> dict[int, Path]:
    """The whole checkpoints (``step_N`` directories holding ``meta.json``) under ``root``, by step."""
    root = Path(root)
    out: dict[int, Path] = {}
    if not root.is_dir():
        return out
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / META_FILE).is_file():
            out[int(m.group(1))] = p
    return out


def retained_steps(steps: list[int] | set[int], *, keep_last: int, keep_every: int,
                   latest: int | None = None) -> set[int]:
    """Which steps retention keeps: the newest ``keep_last`` (0 keeps all), every step divisible by
    ``keep_every`` (0: none), and always ``latest``."""
    steps = sorted(steps)
    if keep_last <= 0:
        return set(steps)
    keep = set(steps[-keep_last:])
    if keep_every > 0:
        keep |= {s for s in steps if s % keep_every == 0}
    if latest is not None:
        keep.add(latest)
    return keep


def clean_pruned(root: str | os.PathLike) -> None:
    """Finish an interrupted prune: remove the ``.prune-*`` directories (they are no checkpoints)."""
    root = Path(root)
    if root.is_dir():
        for p in root.glob(f"{PRUNE_PREFIX}*"):
            shutil.rmtree(p, ignore_errors=True)


def clean_checkpoint_root(root: str | os.PathLike) -> None:
    """Leftovers of any crash under ``root``: interrupted prunes, and every checkpoint's crashed saves
    (``*.tmp-*`` removed, a moved-aside ``*.old-*`` restored when its checkpoint is gone)."""
    root = Path(root)
    if not root.is_dir():
        return
    clean_pruned(root)
    for p in root.glob(f".{LATEST}.tmp-*"):
        p.unlink(missing_ok=True)
    for p in list(root.iterdir()):
        for marker in (".tmp-", ".old-"):
            if marker in p.name and not p.name.startswith("."):
                clean_stale(root / p.name.split(marker)[0])
                break


def prune_checkpoints(root: str | os.PathLike, *, keep_last: int, keep_every: int = 0) -> list[Path]:
    """Delete the checkpoints retention does not keep; return them. Call only after the newest
    checkpoint is committed and ``root/latest`` names it: the checkpoint ``latest`` names is never pruned.

    Oldest first, one at a time: rename to ``.prune-<name>-<pid>`` (atomic; the checkpoint is gone from
    the listing) and then ``rmtree``; a kill in between leaves a ``.prune-*`` that :func:`clean_pruned`
    removes, and every kept checkpoint whole."""
    root = Path(root)
    if keep_last <= 0:
        return []
    clean_pruned(root)
    steps = checkpoint_steps(root)
    latest = latest_checkpoint(root)
    if latest is None or latest.parent != root or _STEP_DIR.match(latest.name) is None:
        return []  # no committed pointer into this root: nothing is provably safe to delete
    keep = retained_steps(set(steps), keep_last=keep_last, keep_every=keep_every,
                          latest=int(_STEP_DIR.match(latest.name).group(1)))
    removed = []
    for step in sorted(set(steps) - keep):
        path = steps[step]
        doomed = root / f"{PRUNE_PREFIX}{path.name}-{os.getpid()}"
        os.replace(path, doomed)
        checkpoint_phase(f"prune:{path.name}")
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    if removed:
        fsync_dir(root)
    return removed


# ------------------------------------------------------------------------------------------ save/load


def save_checkpoint(
    dir: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    value_head: torch.nn.Module | None = None,
    extra: Mapping[str, Any] | None = None,
    reference: torch.nn.Module | None = None,
    stateful: Mapping[str, Any] | None = None,
    update_latest: bool = True,
    adapter_only: bool = False,
) -> Path:
    """Write a checkpoint atomically into ``dir`` and point ``dir.parent/latest`` at it.

    ``stateful`` maps names to extra objects with ``state_dict()`` (e.g. a second optimizer); they are
    stored in ``optim.pt`` and restored by :func:`load_checkpoint` given the same names.
    ``adapter_only``: ``model`` (and ``reference``) are peft models; only their LoRA adapters are written.
    """
    dest = Path(dir).absolute()
    checkpoint_phase(f"save:{dest.name}:begin")
    with staging_dir(dest) as tmp:
        files: list[str] = []

        def done(name: str) -> None:
            fsync_file(tmp / name)
            files.append(name)
            checkpoint_phase(f"save:{dest.name}:{name}")

        model_file, reference_file = (ADAPTER_FILE, REFERENCE_ADAPTER_FILE) if adapter_only else (
            MODEL_FILE, REFERENCE_FILE)
        write = _write_adapter if adapter_only else _write_module
        write(model, tmp / model_file)
        done(model_file)
        if value_head is not None:
            _write_module(value_head, tmp / VALUE_HEAD_FILE)
            done(VALUE_HEAD_FILE)
        if reference is not None:
            write(reference, tmp / reference_file)
            done(reference_file)
        optim = {
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "stateful": {k: v.state_dict() for k, v in (stateful or {}).items() if v is not None},
        }
        _write_torch(optim, tmp / OPTIM_FILE)
        done(OPTIM_FILE)
        _write_torch(rng_state(), tmp / RNG_FILE)
        done(RNG_FILE)
        _write_torch(dict(extra or {}), tmp / EXTRA_FILE)
        done(EXTRA_FILE)
        write_meta(tmp, {"format": FORMAT, "files": files})
    if update_latest:
        checkpoint_phase(f"commit:{dest.name}")
        write_pointer(dest.parent, dest.name)
    return dest


def load_checkpoint(
    dir: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    value_head: torch.nn.Module | None = None,
    reference: torch.nn.Module | Callable[[], torch.nn.Module] | None = None,
    stateful: Mapping[str, Any] | None = None,
    restore_rng: bool = True,
    adapter_only: bool = False,
) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote into the given objects; return the ``extra`` dict.

    ``dir`` may be a checkpoint or a directory holding a ``latest`` pointer. ``reference`` and the values
    of ``stateful`` may be zero-argument factories, called only when the checkpoint holds their state
    (lazily created optimizers / reference models). ``adapter_only``: as given to :func:`save_checkpoint`
    (a checkpoint of the other kind is refused, naming ``actor.lora``).
    """
    path = resolve_checkpoint(dir)
    meta = json.loads((path / META_FILE).read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {meta.get('format')!r}, the embedded actor (actor.name: "
                              f"torch) reads {FORMAT!r}; an 'fsdp-*' checkpoint loads with actor.name: fsdp")
    files = set(meta["files"])
    check_checkpoint_kind(path, adapter_only=adapter_only, holds_adapter=ADAPTER_FILE in files)
    if adapter_only:
        _read_adapter(model, path / ADAPTER_FILE)
    else:
        _read_module(model, path / MODEL_FILE)
    if value_head is not None:
        if VALUE_HEAD_FILE not in files:
            raise CheckpointError(f"checkpoint {path} has no value head but actor.value_head is true: "
                                  "set actor.value_head to what the checkpoint was trained with")
        _read_module(value_head, path / VALUE_HEAD_FILE)
    reference_file = REFERENCE_ADAPTER_FILE if adapter_only else REFERENCE_FILE
    if reference is not None and reference_file in files:
        ref = reference() if callable(reference) and not isinstance(reference, torch.nn.Module) else reference
        (_read_adapter if adapter_only else _read_module)(ref, path / reference_file)
    optim = torch.load(path / OPTIM_FILE, map_location="cpu", weights_only=False)
    if optimizer is not None and optim["optimizer"] is not None:
        optimizer.load_state_dict(optim["optimizer"])
    if scheduler is not None and optim["scheduler"] is not None:
        scheduler.load_state_dict(optim["scheduler"])
    for name, target in (stateful or {}).items():
        if name in optim["stateful"]:
            obj = target() if callable(target) and not hasattr(target, "load_state_dict") else target
            obj.load_state_dict(optim["stateful"][name])
    if restore_rng:
        set_rng_state(torch.load(path / RNG_FILE, map_location="cpu", weights_only=False))
    return torch.load(path / EXTRA_FILE, map_location="cpu", weights_only=False)


def checkpoint_states(dir: str | os.PathLike) -> set[str]:
    """Names of the ``stateful`` entries a checkpoint holds (plus 'reference' / 'value_head' files)."""
    path = resolve_checkpoint(dir)
    optim = torch.load(path / OPTIM_FILE, map_location="cpu", weights_only=False)
    out = set(optim["stateful"])
    files = set(json.loads((path / META_FILE).read_text())["files"])
    if REFERENCE_FILE in files or REFERENCE_ADAPTER_FILE in files:
        out.add("reference")
    if VALUE_HEAD_FILE in files:
        out.add("value_head")
    return out


# ------------------------------------------------------------------------------------------ resume


def resume_candidates(root: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint a resume should load, and the ones it skipped with the reason for each.

    The one ``latest`` names comes first (a whole ``step_N`` that ``latest`` does not name yet is a save
    killed before its commit: it is re-run, see docs/checkpoints.md); when that is missing or corrupt,
    the ``step_N`` directories are tried newest first. ``(None, skipped)`` when nothing is whole."""
    root = Path(root)
    skipped: list[tuple[Path, str]] = []
    if not root.is_dir():
        return None, skipped
    tried: set[Path] = set()
    pointer = root / LATEST
    if pointer.is_file():
        named = latest_checkpoint(root)
        if named is None:
            name = pointer.read_text().strip()
            skipped.append((root / name, f"'{LATEST}' names {name}, which is not there"))
            tried.add(root / name)
        else:
            problem = checkpoint_problem(named)
            if problem is None:
                return named, skipped
            skipped.append((named, problem))
            tried.add(named)
    steps = {}
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and p not in tried:
            steps[int(m.group(1))] = p
    for step in sorted(steps, reverse=True):
        problem = checkpoint_problem(steps[step])
        if problem is None:
            return steps[step], skipped
        skipped.append((steps[step], problem))
    return None, skipped


def set_aside(path: str | os.PathLike) -> Path:
    """Rename a corrupt checkpoint to ``<name>.corrupt-<time>``: kept for inspection, but no longer a
    checkpoint (retention, ``latest`` and later resumes ignore it, and its step can be saved again)."""
    path = Path(path)
    dest = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
    os.replace(path, dest)
    return dest
