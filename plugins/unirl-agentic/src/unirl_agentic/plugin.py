"""The ``unirl.plugins`` entry point of ``unirl-agentic``: the environment and the tools (lazy strings),
the ``agentic-demo`` command, and preflight of ``plugins.agentic``."""

from __future__ import annotations

from typing import Any

from unirl.api import Violation, hookimpl, violations_from

SOURCE = "unirl-agentic"

TOOLS = {"calculator": "unirl_agentic.calculator:Calculator",
         "python_sandbox": "unirl_agentic.sandbox:PythonSandbox",
         "search": "unirl_agentic.search.tools:Search",
         "open": "unirl_agentic.search.tools:Open",
         "visit": "unirl_agentic.search.tools:Visit"}

ENVIRONMENTS = {"tool_env": "unirl_agentic.environment:ToolEnvironment",
                "search": "unirl_agentic.search.environment:SearchEnvironment",
                "textworld": "unirl_agentic.games.environment:TextWorldEnvironment"}


@hookimpl
def unirl_environments() -> dict[str, str]:
    return dict(ENVIRONMENTS)


@hookimpl
def unirl_rewards() -> dict[str, str]:
    return {"exact_match": "unirl_agentic.search.grading:exact_match", "f1": "unirl_agentic.search.grading:f1",
            "env_score": "unirl_agentic.games.environment:env_score"}


@hookimpl
def unirl_rollout_controllers() -> dict[str, str]:
    return {"agentic": "unirl_agentic.controller:KernelAgenticController",
            "openai_agent": "unirl_agentic.openai_controller:KernelOpenAIAgentController"}


@hookimpl
def unirl_tools() -> dict[str, str]:
    return dict(TOOLS)


@hookimpl
def unirl_config_sections() -> dict[str, str]:
    return {"agentic": "unirl_agentic.options:AgenticOptions"}


@hookimpl
def unirl_commands() -> dict[str, str]:
    return {"agentic-demo": "unirl_agentic.demo:main", "agentic-data": "unirl_agentic.data:main"}


@hookimpl
def unirl_preflight(config: Any, kernel: Any) -> list[Violation]:
    """Every problem with ``plugins.agentic`` (and its tool options) in one pass."""
    from pydantic import ValidationError

    from unirl.api import OptionsError, section_options
    from unirl_agentic.options import (
        SECTION,
        agentic_options,
        branching_violations,
        unread_section_violations,
    )

    unread = unread_section_violations(config, set(unirl_rollout_controllers()), set(ENVIRONMENTS))
    if unread:
        return unread

    section = (getattr(config, "plugins", None) or {}).get(SECTION)
    if config.rollout.controller == "openai_agent":
        return _agent_problems(section or {})
    ours = config.rollout.controller == "agentic"
    if ours and not config.rollout.environment:
        return [Violation(SOURCE, "rollout.controller", "the agentic controller drives a multi-turn environment, "
                          "but rollout.environment is not set", "set rollout.environment (e.g. tool_env)")]
    if section is None and config.rollout.environment not in ENVIRONMENTS and not ours:
        return []
    where = f"plugins.{SECTION}"
    try:  # the kernel's validation of the declared section: typed, and kept for the readers at build time
        opts = section_options(kernel, config, SECTION) if kernel is not None else agentic_options(config)
    except OptionsError as exc:
        return exc.violations
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
    out += _environment_problems(config, opts, where)
    out += branching_violations(config, kernel) if ours else []
    branching = getattr(config.rollout, "branching", None)
    if ours and branching is not None:
        late = [t for t in branching.at_turns if t >= opts.max_turns]
        if late:
            out.append(Violation(SOURCE, "rollout.branching.at_turns", f"turns {late} are never reached: a "
                                 f"trajectory has at most plugins.agentic.max_turns = {opts.max_turns} model turns "
                                 f"(0..{opts.max_turns - 1})", f"fork at turns below {opts.max_turns}, or raise "
                                 "plugins.agentic.max_turns"))
    if "python_sandbox" in (config.rollout.tools or []) or "python_sandbox" in opts.tools:
        out += _sandbox_host_problems(opts.tools.get("python_sandbox") or {})
    if config.rollout.environment == "tool_env" and not config.rollout.tools:
        out.append(Violation(SOURCE, "rollout.tools", "tool_env with no tools: the model could only answer",
                             "list the tools, e.g. rollout.tools: [calculator]"))
    return out


def _agent_problems(section: dict[str, Any]) -> list[Violation]:
    """``rollout.controller: openai_agent``: the section, the agent (importable, async) and its parser."""
    from pydantic import ValidationError

    from unirl_agentic.agent_runner import load_agent
    from unirl_agentic.options import AgenticOptions
    from unirl_agentic.tool_parsers import TOOL_PARSERS

    try:
        opts = AgenticOptions.model_validate(section)
    except ValidationError as exc:
        return violations_from(exc, SOURCE, "plugins.agentic", f"known fields: {', '.join(AgenticOptions.model_fields)}")
    if not opts.agent:
        return [Violation(SOURCE, "plugins.agentic.agent", "rollout.controller: openai_agent runs your agent, but "
                          "none is named", "set plugins.agentic.agent: my_pkg.my_agent:run")]
    try:
        load_agent(opts.agent)
    except ValueError as exc:
        return [Violation(SOURCE, "plugins.agentic.agent", str(exc).removeprefix("plugins.agentic.agent: "),
                          "an importable module:function that is async def run(client, task)")]
    if opts.tool_parser not in TOOL_PARSERS:
        return [Violation(SOURCE, "plugins.agentic.tool_parser", f"unknown parser {opts.tool_parser!r}",
                          f"one of {', '.join(sorted(TOOL_PARSERS))}")]
    return []


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


def _environment_problems(config: Any, opts: Any, where: str) -> list[Violation]:
    """The environments' own sections, and their dataset files (written by ``unirl agentic-data``)."""
    from pathlib import Path

    from pydantic import ValidationError

    from unirl_agentic.data import DATA_ENVIRONMENTS
    from unirl_agentic.word_tokenizer import word_tokenizer_unset

    out: list[Violation] = []
    for name, (section, model_path) in DATA_ENVIRONMENTS.items():
        module, _, attr = model_path.partition(":")
        import importlib

        model = getattr(importlib.import_module(module), attr)
        try:
            options = model.model_validate(getattr(opts, section))
        except ValidationError as exc:
            out += [Violation(SOURCE, ".".join([where, section, *map(str, e["loc"])]), e["msg"],
                              f"known fields: {', '.join(model.model_fields)}") for e in exc.errors()]
            continue
        if config.rollout.environment != name:
            continue
        for field in ("source", "eval_source"):
            path = getattr(config.data, field)
            if path and path != "arith" and not Path(path).is_file():
                out.append(Violation(SOURCE, f"data.{field}", f"{path} does not exist: the {name} environment's "
                                     "questions are generated, not shipped",
                                     "write them first: unirl agentic-data RECIPE (the same overrides)"))
        if options.word_tokenizer:
            unset = word_tokenizer_unset(config, section)
            if unset is not None:
                out.append(Violation(SOURCE, *unset))
            elif not Path(config.model.tokenizer, "tokenizer.json").is_file():
                out.append(Violation(SOURCE, "model.tokenizer", f"{config.model.tokenizer} holds no tokenizer.json "
                                     f"yet: the {section} word tokenizer is written with the data",
                                     "write it first: unirl agentic-data RECIPE (the same overrides)"))
    return out
