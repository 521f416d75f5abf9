"""Tool-call parsers for the OpenAI-compatible endpoint: a completion's text -> ``content`` + ``tool_calls``.

Why a registry: each model family writes its calls its own way (Qwen3's ``<tool_call>`` JSON blocks,
Llama's ``<|python_tag|>``, Mistral's ``[TOOL_CALLS]``); the server picks one by name
(``plugins.agentic.tool_parser``) and a plugin may add its own with :func:`register_tool_parser`.
A parser never changes the tokens: it reads the text of what was sampled, the ids train as they are.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedTurn:
    """One completion as the OpenAI API returns it: the text outside the calls, and the calls."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


ToolParser = Callable[[str], ParsedTurn]
TOOL_PARSERS: dict[str, ToolParser] = {}


def register_tool_parser(name: str, parser: ToolParser) -> None:
    """Make ``parser`` available as ``plugins.agentic.tool_parser: name``."""
    TOOL_PARSERS[name] = parser


def tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise KeyError(f"no tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]


def openai_call(name: str, arguments: Any) -> dict[str, Any]:
    """A tool call in the Chat Completions wire format (``arguments`` is a JSON string there)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, separators=(",", ":"))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


_QWEN3 = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_qwen3(text: str) -> ParsedTurn:
    """Qwen3 (and Qwen2.5, Hermes): ``<tool_call>{"name": .., "arguments": {..}}</tool_call>`` blocks.

    A block that is not a JSON object with a string ``name`` stays in ``content`` (the agent sees what
    the model wrote, as with a real server); the calls are taken out of it."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _QWEN3.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(openai_call(obj["name"], args if args is not None else {}))
        kept.append(text[pos:m.start()])
        pos = m.end()
    kept.append(text[pos:])
    return ParsedTurn("".join(kept).strip() if calls else text, calls)


def parse_none(text: str) -> ParsedTurn:
    """No tool calls: the completion is content only."""
    return ParsedTurn(text)


register_tool_parser("qwen3", parse_qwen3)
register_tool_parser("none", parse_none)
