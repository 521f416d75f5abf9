"""The ``unirl.plugins`` entry point of ``unirl-agentic``: the environment and the tools (lazy strings),
the ``agentic-demo`` command, and preflight of ``plugins.agentic``."""

from __future__ import annotations

from typing import Any

from unirl.api import Violation, hookimpl

SOURCE = "unirl-agentic"

TOOLS = {"calculator": "unirl_agentic.calculator:Calculator",
         "python_sandbox": "unirl_agentic.sandbox:PythonSandbox"}


@hookimpl
def unirl_environments() -> dict[str, str]:
    return {"tool_env": "unirl_agentic.environment:ToolEnvironment"}


@hookimpl
def unirl_rollout_controllers() -> dict[str, str]:
    return {"agentic": "unirl_agentic.controller:KernelAgenticController"}


@hookimpl
def unirl_tools() -> dict[str, str]:
    return dict(TOOLS)


@hookimpl
def unirl_commands() -> dict[str, str]:
    return {"agentic-demo": "unirl_agentic.demo:main"}


@hookimpl
def unirl_preflight(config: Any) -> list[Violation]:
    """Every problem with ``plugins.agentic`` (and its tool options) in one pass."""
    from pydantic import ValidationError

    from unirl_agentic.options import SECTION, AgenticOptions

    section = (getattr(config, "plugins", None) or {}).get(SECTION)
    ours = config.rollout.controller == "agentic"
    if ours and not config.rollout.environment:
        return [Violation(SOURCE, "rollout.controller", "the agentic controller drives a multi-turn environment, "
                          "but rollout.environment is not set", "set rollout.environment (e.g. tool_env)")]
    if section is None and config.rollout.environment != "tool_env" and not ours:
        return []
    where = f"plugins.{SECTION}"
    try:
        opts = AgenticOptions.model_validate(section or {})
    except ValidationError as exc:
        return [Violation(SOURCE, ".".join([where, *map(str, e["loc"])]), e["msg"],
                          f"known fields: {', '.join(AgenticOptions.model_fields)}") for e in exc.errors()]
    out: list[Violation] = []
    for name, tool_opts in opts.tools.items():
        if name not in TOOLS:
            continue  # a third-party tool validates its own options
        module, _, attr = TOOLS[name].partition(":")
        import importlib

        cls = getattr(importlib.import_module(module), attr)
        try:
            cls.Config.model_validate(tool_opts)
        except ValidationError as exc:
            out += [Violation(SOURCE, ".".join([where, "tools", name, *map(str, e["loc"])]), e["msg"],
                              f"known fields: {', '.join(cls.Config.model_fields)}") for e in exc.errors()]
    if "python_sandbox" in (config.rollout.tools or []) or "python_sandbox" in opts.tools:
        out += _sandbox_host_problems(opts.tools.get("python_sandbox") or {})
    if config.rollout.environment == "tool_env" and not config.rollout.tools:
        out.append(Violation(SOURCE, "rollout.tools", "tool_env with no tools: the model could only answer",
                             "list the tools, e.g. rollout.tools: [calculator]"))
    return out


def _sandbox_host_problems(options: dict[str, Any]) -> list[Violation]:
    """What the host must provide for ``python_sandbox`` (its account, its interpreter, bubblewrap).

    Why here: the tool is built with the rollout, after the actor's model, so a ``user`` that names no
    account would otherwise fail minutes in with a bare ``KeyError``."""
    from pydantic import ValidationError

    from unirl_agentic.sandbox import SandboxOptions, account_problem, isolation_problem, python_problem

    try:
        o = SandboxOptions.model_validate(options)
    except ValidationError:
        return []  # reported field by field above
    found = [p for p in (account_problem(o), python_problem(o)) if p is not None]
    if not found:  # fail closed: no OS sandbox here (bubblewrap missing or refused) is a violation with the fix
        found = [p for p in (isolation_problem(o),) if p is not None]
    return [Violation(SOURCE, *p) for p in found]
