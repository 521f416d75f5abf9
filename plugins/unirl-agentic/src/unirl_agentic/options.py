"""``plugins.agentic``: the one config section of this plugin, validated in preflight."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from unirl.api import StrictOptions, Violation, plugin_section

SECTION = "agentic"
SOURCE = "unirl-agentic"


class AgenticOptions(StrictOptions):
    """Environment and controller settings (tool settings live under ``tools.<name>``)."""

    # the environment
    max_turns: int = Field(4, ge=1, description="model turns per trajectory at most")
    format: Literal["plain", "qwen3"] = Field(
        "plain", description="how a tool result is rendered as a turn: plain tags, or Qwen3's chat template")
    # the controller
    workers: int = Field(1, ge=1, description="environment workers (threads that run env steps and tools)")
    env_workers: int = Field(
        0, ge=0, description="Ray actors that hold the environment (unirl_agentic.pool); 0 runs it in-process. "
        "A lost worker fails only its trajectories")
    trajectories_per_worker: int = Field(
        64, ge=1, description="live trajectories per worker; the pool holds workers * this")
    max_inflight_requests: int = Field(
        64, ge=1, description="model turns submitted to the engine at once (engine request concurrency)")
    over_generate: float = Field(
        1.0, ge=1.0, description="groups launched per group committed (partial rollout when > 1)")
    tail: Literal["auto", "carry", "drop"] = Field(
        "auto", description="what happens to unfinished trajectories at a weight sync: carry them into the "
        "next drive (stateless envs), drop them (stateful envs); auto picks by the environment")
    interrupt: Literal["drain", "abort"] = Field(
        "drain", description="how the tail reaches a turn boundary: let in-flight turns finish (kept, stamped "
        "with the old version) or abort and rewind them (regenerated later; the sync waits less)")
    warm_start: Literal["answer", "calculator", "env", "agent"] = Field(
        "answer", description="SFT traces for the trainer's warm start (sft.steps): the answer alone, a "
        "calculator call on the prompt's expression, its result as a tool turn, then the answer (arith tasks), "
        "or env: the environment's own demonstrations (search lookups, a TextWorld walkthrough), or agent: the "
        "demonstration(task, expert) conversations of the agent's module (rollout.controller: openai_agent)")
    warm_start_tool_share: float = Field(
        1.0, ge=0.0, le=1.0, description="with warm_start: calculator (or env), the share of traces that call the "
        "tool (that are expert demonstrations); the rest answer at once (unaided, or a non-expert trace). Below 1 the warm-started policy calls the tool only sometimes, so "
        "RL has a real choice to learn: when to use the tool")
    tools: dict[str, dict[str, Any]] = Field(default_factory=dict, description="per-tool options, by tool name")
    # rollout.controller: openai_agent (bring your own agent; unirl_agentic.openai_controller)
    agent: str | None = Field(None, description="the agent, 'module:function': async def run(client: "
                              "openai.AsyncOpenAI, task: dict) -> float | dict")
    concurrency: int = Field(64, ge=1, description="agents running at once (openai_agent)")
    agent_timeout_s: float = Field(600.0, gt=0, description="an agent running longer fails its trajectory")
    tool_parser: str = Field("qwen3", description="how a completion's text becomes tool_calls (openai_agent; "
                             "unirl_agentic.tool_parsers)")
    # the environments' own sections (validated by their option models in preflight)
    search: dict[str, Any] = Field(default_factory=dict, description="the search environment's corpus "
                                   "(unirl_agentic.search.corpus.CorpusOptions)")
    textworld: dict[str, Any] = Field(default_factory=dict, description="the textworld environment's games "
                                      "(unirl_agentic.games.options.TextWorldOptions)")


def agentic_options(config: Any) -> AgenticOptions:
    """The section of ``config`` as the kernel validated it against :class:`AgenticOptions` (the model
    this plugin declares through ``unirl_config_sections``; defaults when absent): the one reader, so
    nothing here parses ``plugins.agentic`` by hand. Raises ``OptionsError`` naming a bad key."""
    return plugin_section(config, SECTION)


def tool_options(config: Any, name: str) -> dict[str, Any]:
    """``plugins.agentic.tools.<name>`` (``{}`` without a config or the key): the tool validates it."""
    return agentic_options(config).tools.get(name) or {} if config is not None else {}


def unread_section_violations(config: Any, controllers: set[str], environments: set[str]) -> list[Violation]:
    """``plugins.agentic`` given while neither a controller nor an environment of this plugin is selected
    (``controllers`` / ``environments``: the names it registers): nothing would read the section."""
    if (getattr(config, "plugins", None) or {}).get(SECTION) is None:
        return []
    r = config.rollout
    if r.controller in controllers or r.environment in environments:
        return []
    return [Violation(SOURCE, f"plugins.{SECTION}", f"set, but rollout.controller is {r.controller!r} and "
                      f"rollout.environment is {r.environment!r}: nothing of unirl-agentic runs, so the section "
                      "would be ignored", f"set rollout.controller: {sorted(controllers)[0]} with rollout.environment "
                      f"(one of {', '.join(sorted(environments))}), or remove plugins.{SECTION}")]


def branching_violations(config: Any, kernel: Any) -> list[Violation]:
    """``rollout.branching`` with a stateful environment or tool: a fork cannot copy a tool session. The
    controller refuses it when built; here it is refused in preflight, before any model is built. What is
    stateful is read from the classes (:attr:`Environment.stateful` when it is a plain class value, and
    :class:`~unirl_agentic.tooling.StatefulTool`), never from names."""
    import inspect

    r = config.rollout
    if getattr(r, "branching", None) is None or not r.environment:
        return []
    from unirl_agentic.tooling import StatefulTool

    stateful: list[str] = []
    for kind, names in (("environments", [r.environment]), ("tools", list(r.tools or []))):
        for name in names:
            try:
                cls = kernel.get(kind, name).load()
            except Exception:  # noqa: BLE001 - an unknown name is core's violation
                continue
            value = inspect.getattr_static(cls, "stateful", False) if isinstance(cls, type) else False
            if (isinstance(cls, type) and issubclass(cls, StatefulTool)) or value is True:
                stateful.append(f"{kind[:-1]} {name!r}")
    if not stateful:
        return []
    return [Violation(SOURCE, "rollout.branching", f"{' and '.join(stateful)} is stateful (a trajectory holds a "
                      "session outside its tokens, which a fork cannot copy)",
                      "remove rollout.branching, or use a stateless environment and tools (e.g. tool_env with "
                      "calculator)")]
