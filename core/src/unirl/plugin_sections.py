"""``plugins.<name>`` sections checked against what the loaded plugins read.

Why: ``RunConfig.plugins`` is free-form, because core cannot know a plugin's keys; so a section that
no plugin reads (a typo such as ``plugins.agentc``, or a plugin that is not installed) was accepted and
silently ignored. Each plugin declares the sections it reads through the ``unirl_config_sections``
capability hook (the kernel's ``config_sections`` registry); a section no loaded plugin declares is a
violation naming the closest declared one. Validating a declared section's keys stays the declaring
plugin's job (its ``unirl_preflight``), so each bad key is reported once.
"""

from __future__ import annotations

import difflib

from unirl.config import RunConfig
from unirl.kernel.errors import PluginError, Violation
from unirl.kernel.manager import Kernel

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
