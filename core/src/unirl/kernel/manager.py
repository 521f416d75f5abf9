"""Plugin discovery and the named registries.

The kernel finds plugins through the ``unirl.plugins`` entry-point group (core's own built-ins arrive
the same way, as the entry point ``core``), asks each one's capability hooks for ``{name: factory}``
and merges the answers into registries that remember which distribution registered what.

A plugin that fails to import, raises in a hook or returns the wrong type is *isolated*: it is
recorded with its error and the run goes on. It becomes fatal only when the run selects a name it
would have provided (see :meth:`Kernel.get`).

A plugin declares the core releases it works with as its ``unirl-core`` requirement (e.g.
``unirl-core>=0.1,<0.2``). Discovery reads that range from the installed metadata *before* importing the
plugin: a plugin built for another core is recorded as failed with the fix (see :func:`core_mismatch`),
not imported into a core whose API it was not built against.

Entry points are read with ``importlib_metadata`` (a declared dependency of unirl-core): one API, and
one behaviour for ``entry_points(group=...)`` and ``Distribution.requires``, on every Python version.

``UNIRL_PLUGINS=a,b`` is an allowlist of entry-point names, like vLLM's ``VLLM_PLUGINS``; the core
entry point is always loaded because nothing runs without it. A name in it that no installed plugin
has is an error (:func:`check_allowlist`), not a warning: a typo would otherwise drop the plugin the
user meant, silently, and the run would train without it.
"""

from __future__ import annotations

import difflib
import importlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import importlib_metadata as md
import pluggy

from unirl.kernel import hookspecs
from unirl.kernel.errors import PluginError
from unirl.kernel.options import validate_options


class _Unset:
    """``Kernel.build`` called without ``options``: the kind has no options section (an adapter, a tool)."""


_UNSET = _Unset()

GROUP = "unirl.plugins"
CORE_ENTRY_POINT = "core"
CORE_DIST = "unirl-core"


@dataclass
class Entry:
    """One registered component: a name, its factory and where it came from."""

    kind: str
    name: str
    factory: Callable[..., Any] | str
    dist: str
    version: str

    def load(self) -> Callable[..., Any]:
        """Resolve a lazy ``"module:attr"`` factory (importing the heavy module only now)."""
        if isinstance(self.factory, str):
            module, _, attr = self.factory.partition(":")
            try:
                obj: Any = importlib.import_module(module)
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except Exception as exc:  # noqa: BLE001 - any import failure is the plugin's fault
                raise PluginError(
                    f"{self.kind} '{self.name}' from distribution {self.dist} {self.version} failed to "
                    f"load ({self.factory}): {type(exc).__name__}: {exc}"
                ) from exc
            self.factory = obj
        return self.factory


@dataclass
class PluginRecord:
    """What ``unirl plugins`` shows for one entry point."""

    entry_point: str
    dist: str
    version: str
    module: str
    status: str = "loaded"  # loaded | failed | disabled
    error: str = ""
    registers: dict[str, list[str]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "entry_point": self.entry_point,
            "distribution": self.dist,
            "version": self.version,
            "module": self.module,
            "status": self.status,
            "error": self.error,
            "registers": self.registers,
        }


def _allowlist() -> set[str] | None:
    raw = os.environ.get("UNIRL_PLUGINS")
    if raw is None or not raw.strip():
        return None
    return {p.strip() for p in raw.split(",") if p.strip()} | {CORE_ENTRY_POINT}


def check_allowlist(allow: set[str] | None, entry_points: Iterable[md.EntryPoint],
                    extra_names: Iterable[str] = ()) -> None:
    """Raise :class:`PluginError` when ``UNIRL_PLUGINS`` names something that is not an installed entry point.

    Why an error even when other names are known: ``UNIRL_PLUGINS=vllm,fsdb`` would load vLLM and
    silently leave FSDP out, and the run would then fail far from the cause (or, worse, train with a
    different plugin set). Checked before any plugin is imported, so nothing is built on a bad list.
    ``extra_names`` are in-process registrations (``load_kernel(extra=...)``), also acceptable names."""
    if allow is None:
        return
    eps = list(entry_points)
    known = {ep.name for ep in eps} | set(extra_names) | {CORE_ENTRY_POINT}
    unknown = sorted(allow - known)
    if not unknown:
        return
    installed = sorted(known - {CORE_ENTRY_POINT})
    # a distribution name ("unirl-vllm") is the commonest slip: map it to its entry point
    by_dist = {_norm(ep.dist.name): ep.name for ep in eps if ep.dist is not None}
    guesses: dict[str, str] = {}
    for name in unknown:
        guess = by_dist.get(_norm(name)) or next(iter(difflib.get_close_matches(name, installed, n=1)), None)
        if guess:
            guesses[name] = guess
    shown = ", ".join(f"'{n}'" + (f" (did you mean '{guesses[n]}'?)" if n in guesses else "") for n in unknown)
    raw = os.environ.get("UNIRL_PLUGINS", "").strip()
    if len(guesses) == len(unknown):
        fixed = ",".join(guesses.get(p.strip(), p.strip()) for p in raw.split(",") if p.strip())
        fix = f"set UNIRL_PLUGINS={fixed}, or unset UNIRL_PLUGINS to load every installed plugin"
    else:
        fix = ("list installed entry-point names, comma-separated (e.g. UNIRL_PLUGINS=vllm,fsdp), or unset "
               "UNIRL_PLUGINS to load every installed plugin")
    raise PluginError(
        f"UNIRL_PLUGINS={raw}: {shown} {'is' if len(unknown) == 1 else 'are'} not the entry point of any "
        f"installed plugin, so the plugin meant would be left out (installed entry points: "
        f"{', '.join(installed) or 'none'}) (fix: {fix})")


def core_version() -> str | None:
    """The installed unirl-core's version (None when core runs from a source tree without metadata)."""
    try:
        return md.version(CORE_DIST)
    except md.PackageNotFoundError:
        return None


def core_mismatch(dist: Any, core: str | None = None) -> str:
    """Why ``dist`` (an installed distribution) must not load next to this core, or ``""``.

    Reads the plugin's ``unirl-core`` requirement from its metadata (``Requires-Dist``), so nothing of
    the plugin is imported. Why at discovery: a plugin built against another core's hook specs and
    contracts fails far from the cause (an ``ImportError`` of a moved name, or a hook that silently
    never fires); the range its author declared says so up front. A plugin that declares no range is
    trusted (there is nothing to check), and so is any plugin when core's own version is unknown."""
    core = core if core is not None else core_version()
    if dist is None or core is None or _norm(getattr(dist, "name", "") or "") == _norm(CORE_DIST):
        return ""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    try:
        requires = list(dist.requires or [])
    except Exception:  # noqa: BLE001 - unreadable metadata is not a version mismatch
        return ""
    try:
        have = Version(core)
    except InvalidVersion:
        return ""
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if _norm(req.name) != _norm(CORE_DIST) or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        if not req.specifier or req.specifier.contains(have, prereleases=True):
            continue
        name, version = dist.name, getattr(dist, "version", "?")
        return (f"{name} {version} needs unirl-core{req.specifier}, but unirl-core {core} is installed, so it was not "
                f"loaded (fix: pip install '{name}' again to get a release for unirl-core {core}, or pip install "
                f"'unirl-core{req.specifier}')")
    return ""


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


class Kernel:
    """The plugin manager plus its registries. Build one with :func:`load_kernel`."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginRecord] = []
        self.registries: dict[str, dict[str, Entry]] = {
            hookspecs.kind_of(h): {} for h in hookspecs.CAPABILITY_HOOKS
        }
        self._records_by_name: dict[str, PluginRecord] = {}
        self._extras: list[tuple[str, Any]] = []
        self._discovered = False
        self._order: dict[str, int] = {}  # entry-point name -> registration index (the walk's tiebreak)

    # ---------------------------------------------------------------- registration
    def register(self, module: ModuleType | object, *, entry_point: str, dist: str, version: str) -> PluginRecord:
        """Register one plugin object and merge its capabilities. Failures are recorded, not raised."""
        record = PluginRecord(entry_point, dist, version, getattr(module, "__name__", repr(module)))
        self.plugins.append(record)
        try:
            self.pm.register(module, name=entry_point)
        except Exception as exc:  # noqa: BLE001 - pluggy validation errors and name clashes
            record.status, record.error = "failed", f"{type(exc).__name__}: {exc}"
            return record
        wrappers = _wrapper_impls(self.pm, entry_point)
        if wrappers:
            self.pm.unregister(name=entry_point)
            record.status = "failed"
            raise HookWrapperError(
                f"plugin '{entry_point}' ({dist} {version}) marks {', '.join(wrappers)} as a hook wrapper "
                "(@hookimpl(wrapper=True) or hookwrapper=True); UniRL calls each implementation with only the "
                "arguments it declares and keeps every answer, so it has no wrappers (fix: drop wrapper=/"
                "hookwrapper= and write a plain implementation; use tryfirst=True or trylast=True to order it)")
        self._order.setdefault(entry_point, len(self._order))
        self._records_by_name[entry_point] = record
        staged: dict[str, dict[str, Entry]] = {}
        for hook_name in hookspecs.CAPABILITY_HOOKS:
            impl = getattr(module, hook_name, None)
            if impl is None:
                continue
            kind = hookspecs.kind_of(hook_name)
            try:
                answer = impl()
            except Exception as exc:  # noqa: BLE001
                self._fail(record, f"{hook_name}() raised {type(exc).__name__}: {exc}")
                return record
            problem = _check_factories(answer)
            if problem:
                self._fail(record, f"{hook_name}() {problem}")
                return record
            staged[kind] = {n: Entry(kind, n, f, dist, version) for n, f in (answer or {}).items()}
        for kind, entries in staged.items():
            for name, entry in entries.items():
                prior = self.registries[kind].get(name)
                if prior is not None:
                    raise PluginError(
                        f"{kind} name '{name}' is registered twice: by {prior.dist} {prior.version} and by "
                        f"{dist} {version}. Uninstall one of them, or allowlist one with UNIRL_PLUGINS."
                    )
                self.registries[kind][name] = entry
                record.registers.setdefault(kind, []).append(name)
        return record

    def _fail(self, record: PluginRecord, error: str) -> None:
        record.status, record.error = "failed", error
        self.pm.unregister(name=record.entry_point)
        self._records_by_name.pop(record.entry_point, None)

    def discover(self, entry_points: Iterable[md.EntryPoint] | None = None, *,
                 extra_names: Iterable[str] = ()) -> None:
        """Load every ``unirl.plugins`` entry point (respecting ``UNIRL_PLUGINS``, which must name only
        installed entry points or ``extra_names``: see :func:`check_allowlist`)."""
        self._discovered = True
        allow = _allowlist()
        eps = list(entry_points if entry_points is not None else md.entry_points(group=GROUP))
        check_allowlist(allow, eps, extra_names)
        core = core_version()
        seen: set[str] = set()
        for ep in sorted(eps, key=lambda e: (e.name != CORE_ENTRY_POINT, e.name)):
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else "?"
            if ep.name in seen:  # the same distribution visible twice on sys.path
                continue
            seen.add(ep.name)
            if allow is not None and ep.name not in allow:
                self.plugins.append(PluginRecord(ep.name, dist, version, ep.value, status="disabled",
                                                 error="not in UNIRL_PLUGINS"))
                continue
            mismatch = core_mismatch(ep.dist, core)
            if mismatch:  # checked from metadata, before the plugin's code is imported
                self.plugins.append(PluginRecord(ep.name, dist, version, ep.value, status="failed",
                                                 error=f"incompatible core: {mismatch}"))
                continue
            try:
                module = ep.load()
            except Exception as exc:  # noqa: BLE001 - a broken plugin must not take the kernel down
                self.plugins.append(PluginRecord(ep.name, dist, version, ep.value, status="failed",
                                                 error=f"import failed: {type(exc).__name__}: {exc}"))
                continue
            try:
                self.register(module, entry_point=ep.name, dist=dist, version=version)
            except HookWrapperError as exc:  # an installed plugin's bug: isolated, like a failed import
                self.plugins[-1].error = str(exc)

    # ---------------------------------------------------------------- lookup
    def names(self, kind: str) -> list[str]:
        return sorted(self.registries[kind])

    def get(self, kind: str, name: str) -> Entry:
        """The entry for ``name``, or an error that says what exists and which plugins failed."""
        registry = self.registries[kind]
        if name in registry:
            return registry[name]
        failed = [p for p in self.plugins if p.status == "failed"]
        disabled = [p for p in self.plugins if p.status == "disabled"]
        msg = f"no {kind.rstrip('s').replace('_', ' ')} named '{name}'. Registered: {', '.join(sorted(registry)) or 'none'}."
        suspects = [p for p in failed if name in p.entry_point or name in p.dist]
        for p in suspects or failed:
            msg += f"\n  plugin '{p.entry_point}' ({p.dist} {p.version}) failed to load and may provide it: {p.error}"
        for p in disabled:
            if name in p.entry_point or name in p.dist:
                msg += f"\n  plugin '{p.entry_point}' ({p.dist}) is disabled by UNIRL_PLUGINS; add it to the list."
        if not failed and not disabled:
            msg += " Is the plugin that provides it installed (`unirl plugins` lists what is)?"
        raise PluginError(msg)

    def declaration(self, kind: str, name: str) -> Any:
        """The class that declares component ``name`` of ``kind`` (``Config``, ``capabilities``,
        ``memory_layout``): its registered light declaration (``unirl_declarations``) when it has one, else
        the component's own class. A declaration the component's class does not inherit is refused: the
        two would disagree."""
        entry = self.get(kind, name)
        light = self.registries["declarations"].get(f"{kind}.{name}")
        if light is None:
            return entry.load()
        declared = light.load()
        if not isinstance(entry.factory, str) and not (isinstance(entry.factory, type)
                                                       and issubclass(entry.factory, declared)):
            raise PluginError(f"{kind} '{name}' from {entry.dist}: its declaration {light.factory} is not a base "
                              "class of the component (fix: the component's class inherits its declaration)")
        return declared

    def build(self, kind: str, name: str, *, options: Mapping[str, Any] | None | _Unset = _UNSET,
              options_at: str = "", **kwargs: Any) -> Any:
        """Build component ``name`` of ``kind`` with ``kwargs``.

        With ``options`` (the raw config section given at ``options_at``, e.g. ``rollout.options``),
        the options are validated against the model the factory declares (``Config``) and the factory
        gets the validated object as ``options=`` (None when it declares none): the one validation of
        a component's options. A bad option raises :class:`~unirl.kernel.errors.OptionsError` naming
        the field, before the factory runs."""
        entry = self.get(kind, name)
        factory = entry.load()
        if not isinstance(options, _Unset):
            kwargs["options"] = self.options(kind, name, options, options_at, factory=factory)
        return factory(**kwargs)

    def options(self, kind: str, name: str, raw: Mapping[str, Any] | None, at: str, *,
                factory: Any = None) -> Any:
        """``raw`` (given at ``at``) validated against the options model of ``name``'s factory; see
        :mod:`unirl.kernel.options`. Preflight reports the :class:`OptionsError` this raises."""
        entry = self.get(kind, name)
        return validate_options(factory if factory is not None else entry.load(), raw, name=name,
                                source=entry.dist, field=at or f"options of {kind} '{name}'")

    def dist_of(self, entry_point: str) -> str:
        rec = self._records_by_name.get(entry_point)
        return rec.dist if rec else entry_point

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def walk(self, hook_name: str) -> list[Any]:
        """The implementations of ``hook_name`` in the one order every hook call uses.

        Order: ``tryfirst`` implementations, then plain ones, then ``trylast`` ones; within each band,
        registration order (core first, then entry points by name, then in-process registrations).
        Why not pluggy's own order: pluggy calls plain implementations last-registered-first, which
        would put a plugin's preflight answers before core's and make the order depend on the name of
        the last plugin installed. ``tryfirst``/``trylast`` mean what they mean in pluggy. Wrappers are
        refused at :meth:`register`, so none is ever walked."""
        impls = getattr(self.pm.hook, hook_name).get_hookimpls()
        return sorted(impls, key=lambda i: (0 if i.tryfirst else 2 if i.trylast else 1,
                                            self._order.get(i.plugin_name, len(self._order))))

    def call(self, hook_name: str, **kwargs: Any) -> list[Any]:
        """Call one lifecycle hook on every plugin that implements it, in :meth:`walk` order.

        Each implementation receives only the keyword arguments it declares. ``firstresult`` hooks
        return a one-element list (the first non-None answer) or ``[]``. Exceptions propagate (a gate
        that raises must stop the step), with the plugin that raised named in a note."""
        caller = getattr(self.pm.hook, hook_name)
        firstresult = bool(caller.spec and caller.spec.opts.get("firstresult"))
        out: list[Any] = []
        for dist, impl, args in self._calls(hook_name, kwargs):
            try:
                answer = impl.function(**args)
            except Exception as exc:
                exc.add_note(f"(raised by {hook_name} of plugin '{impl.plugin_name}', {dist})")
                raise
            if firstresult and answer is not None:
                return [answer]
            if not firstresult:
                out.append(answer)
        return out

    def _calls(self, hook_name: str, kwargs: dict[str, Any]) -> list[tuple[str, Any, dict[str, Any]]]:
        """``(distribution, impl, the kwargs it declares)`` for each implementation, in walk order."""
        return [(self.dist_of(impl.plugin_name), impl, {k: v for k, v in kwargs.items() if k in impl.argnames})
                for impl in self.walk(hook_name)]

    def implements(self, hook_name: str) -> bool:
        return bool(getattr(self.pm.hook, hook_name).get_hookimpls())

    def spec(self) -> KernelSpec:
        """How another process rebuilds this plugin set: the same allowlist, the same entry points,
        plus every in-process registration whose module is importable (with the directory it was
        imported from). Ray ranks and engine hosts load it with :meth:`KernelSpec.load`."""
        extras, unshippable = [], []
        for name, module in self._extras:
            mod_name = getattr(module, "__name__", None)
            file = getattr(module, "__file__", None)
            if not mod_name or not file or mod_name == "__main__":
                unshippable.append(name)  # fine in this process; an error only where it must be rebuilt
                continue
            root = Path(file).resolve().parent
            for _ in range(mod_name.count(".")):
                root = root.parent
            extras.append((name, mod_name, str(root)))
        return KernelSpec(allowlist=os.environ.get("UNIRL_PLUGINS"), discover=self._discovered,
                          extras=tuple(extras), unshippable=tuple(unshippable))

    def worker_env(self, config: Any) -> dict[str, str]:
        """Merge every plugin's ``unirl_worker_env``; a variable set two ways is an error naming both.

        Here, in the kernel, because :func:`unirl.runtime.build_runtime` needs it and the runtime sits
        below preflight in core's layers."""
        merged: dict[str, str] = {}
        owner: dict[str, str] = {}
        for dist, answer in self.call_each("unirl_worker_env", config=config):
            if not answer:
                continue
            if not isinstance(answer, dict):
                raise PluginError(f"{dist}: unirl_worker_env returned {type(answer).__name__}, not a dict")
            for key, value in answer.items():
                value = str(value)
                if key in merged and merged[key] != value:
                    raise PluginError(f"worker env {key} is set to {merged[key]!r} by {owner[key]} and to "
                                      f"{value!r} by {dist}")
                merged[key], owner[key] = value, dist
        return merged

    def call_each(self, hook_name: str, *, isolate: bool = False, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call one lifecycle hook on every plugin, in :meth:`walk` order, returning ``(distribution,
        answer)`` pairs, so reports can name the plugin that answered.

        ``isolate=True`` (preflight) turns an implementation that raises into the answer
        :class:`Raised` instead of propagating, so one broken check cannot hide the others."""
        out: list[tuple[str, Any]] = []
        for dist, impl, args in self._calls(hook_name, kwargs):
            try:
                out.append((dist, impl.function(**args)))
            except Exception as exc:
                if not isolate:
                    exc.add_note(f"(raised by {hook_name} of plugin '{impl.plugin_name}', {dist})")
                    raise
                out.append((dist, Raised(exc)))
        return out


class HookWrapperError(PluginError):
    """A plugin implements a hook as a pluggy wrapper, which UniRL refuses (see :meth:`Kernel.walk`).

    Raised by :meth:`Kernel.register` (an in-process registration fails loudly); discovery records an
    installed plugin with it as ``failed`` instead, so one broken plugin does not stop every run."""


@dataclass(frozen=True)
class Raised:
    """What an isolated hook call (:meth:`Kernel.call_each` with ``isolate=True``) answers for an
    implementation that raised."""

    exc: BaseException


def _wrapper_impls(pm: pluggy.PluginManager, name: str) -> list[str]:
    """The hooks plugin ``name`` implements as a pluggy wrapper (old or new style)."""
    plugin = pm.get_plugin(name)
    return sorted(impl_hook.name for impl_hook in pm.get_hookcallers(plugin) or []
                  for impl in impl_hook.get_hookimpls()
                  if impl.plugin is plugin and (impl.wrapper or impl.hookwrapper))


def _check_factories(answer: Any) -> str:
    if answer is None:
        return ""
    if not isinstance(answer, dict):
        return f"must return a dict of name -> factory, got {type(answer).__name__}"
    for name, factory in answer.items():
        if not isinstance(name, str) or not name:
            return f"returned a non-string name {name!r}"
        if isinstance(factory, str):
            if ":" not in factory:
                return f"returned factory {factory!r} for '{name}': a lazy factory is written 'module:attr'"
        elif not callable(factory):
            return f"returned a non-callable factory for '{name}' ({type(factory).__name__})"
    return ""


def load_kernel(*, discover: bool = True, extra: Iterable[tuple[str, object]] = ()) -> Kernel:
    """Build a kernel: every installed plugin, plus ``extra`` ``(name, module)`` pairs (for tests)."""
    kernel = Kernel()
    extra = list(extra)
    if discover:
        kernel.discover(extra_names=[name for name, _ in extra])
    for name, module in extra:
        kernel.register(module, entry_point=name, dist=name, version="local")
        kernel._extras.append((name, module))
    return kernel


@dataclass(frozen=True)
class KernelSpec:
    """A picklable recipe for the same plugin set in another process (see :meth:`Kernel.spec`)."""

    allowlist: str | None
    discover: bool
    extras: tuple[tuple[str, str, str], ...] = ()  # (entry-point name, module, sys.path root)
    unshippable: tuple[str, ...] = ()  # in-process plugins that are not importable modules

    def load(self) -> Kernel:
        import sys

        if self.unshippable:
            raise PluginError(
                f"in-process plugin(s) {', '.join(self.unshippable)} are not importable modules, so this process "
                "(a Ray rank or an engine host) cannot register them: define them in a module file, or install "
                "them with a unirl.plugins entry point")
        if self.allowlist is not None:
            os.environ["UNIRL_PLUGINS"] = self.allowlist
        modules = []
        for name, mod_name, root in self.extras:
            if root not in sys.path:
                sys.path.append(root)
            modules.append((name, importlib.import_module(mod_name)))
        return load_kernel(discover=self.discover, extra=modules)


class KernelHooks:
    """The run's hook caller, handed to components (actors, engines, ranks) instead of a kernel.

    In the trainer's process it *is* the trainer's kernel. Pickled into a Ray rank or an engine host it
    carries only the :class:`KernelSpec` and rebuilds the same plugin set there, once, on first use:
    one plugin set per run, in every process.
    """

    def __init__(self, kernel: Kernel) -> None:
        self._kernel: Kernel | None = kernel
        self.spec = kernel.spec()

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.spec, self._kernel = state["spec"], None

    @property
    def kernel(self) -> Kernel:
        if self._kernel is None:
            self._kernel = self.spec.load()
        return self._kernel

    def call(self, hook_name: str, **kwargs: Any) -> list[Any]:
        return self.kernel.call(hook_name, **kwargs)

    def implements(self, hook_name: str) -> bool:
        return self.kernel.implements(hook_name)
