"""``plugins.<name>`` sections checked against what the loaded plugins read.

Why: ``RunConfig.plugins`` is free-form, because core cannot know a plugin's keys; so a section that
no plugin reads (a typo such as ``plugins.agentc``, or a plugin that is not installed) was accepted and
silently ignored. Each plugin declares the sections it reads through the ``unirl_config_sections``
capability hook (the kernel's ``config_sections`` registry); a section no loaded plugin declares is a
violation naming the closest declared one.

A declared section is validated against the model its plugin declares by the kernel's one options
validation (:func:`unirl.kernel.options.validate_options`, as for component options):
:func:`section_options` in the plugin's ``unirl_preflight`` (so each bad key is reported once, by the
plugin that owns the model) and :func:`plugin_section` where the plugin reads it, which hands back the
same typed model (validated once per config object) instead of each reader parsing raw dicts again.
"""

from __future__ import annotations

import difflib
from types import SimpleNamespace
from typing import Any

from unirl.config import RunConfig
from unirl.kernel.errors import PluginError, Violation
from unirl.kernel.manager import Kernel
from unirl.kernel.options import validate_options

CORE = "unirl-core"
KIND = "config_sections"


def section_violations(config: RunConfig, kernel: Kernel) -> list[Violation]:
    """One violation per ``plugins.<name>`` that no loaded plugin declares it reads."""
    declared = kernel.names(KIND)
    out: list[Violation] = []
    for name in config.plugins:
        if name in declared:
            continue
        close = difflib.get_close_matches(name, declared, n=1)
        try:
            kernel.get(KIND, name)
        except PluginError as exc:  # names a plugin that failed to load or is disabled, when one is
            why = str(exc).split(". Registered:")[0].replace("no config section named", "no loaded plugin reads")
            detail = [line.strip() for line in str(exc).splitlines()[1:]]
        fix = (f"did you mean plugins.{close[0]}?" if close else
               f"remove it, or install the plugin that reads it (sections read here: {', '.join(declared) or 'none'})")
        out.append(Violation(CORE, f"plugins.{name}", f"{why}: the section would be ignored"
                             + (f" ({'; '.join(detail)})" if detail else ""), fix))
    return out


#: typed sections already validated, most recent first: (config object, section name, typed model)
_TYPED: list[tuple[Any, str, Any]] = []
_KEEP = 16


def section_options(kernel: Kernel, config: Any, name: str) -> Any:
    """``plugins.<name>`` of ``config`` validated against the model its plugin declares
    (``unirl_config_sections``), by the kernel's options validation (defaults when the section is
    absent). Raises :class:`OptionsError` naming ``plugins.<name>.<key>``; the typed model is kept for
    this config object, so a later read does not validate it again."""
    for seen, section, typed in _TYPED:
        if seen is config and section == name:
            return typed
    entry = kernel.get(KIND, name)
    raw = (getattr(config, "plugins", None) or {}).get(name)
    holder = SimpleNamespace(Config=entry.load())  # the section's model, as a component declares its Config
    typed = validate_options(holder, raw, name=name, source=entry.dist, field=f"plugins.{name}")
    _TYPED.insert(0, (config, name, typed))
    del _TYPED[_KEEP:]
    return typed


def plugin_section(config: Any, name: str, kernel: Kernel | None = None) -> Any:
    """:func:`section_options` for a plugin's own code, which holds no kernel at build time (a tool, an
    environment): ``kernel`` None resolves the declaration from the installed plugins."""
    if kernel is None:
        for seen, section, typed in _TYPED:  # validated already (preflight): no kernel needed
            if seen is config and section == name:
                return typed
        from unirl.kernel.manager import load_kernel

        kernel = load_kernel()
    return section_options(kernel, config, name)
