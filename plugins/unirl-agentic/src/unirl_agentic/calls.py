"""Tool calls in a model turn, Qwen3 style: ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``.

A malformed call is not an exception: it becomes a :class:`CallError` that the environment shows the
model as an error observation, so the model can learn to call correctly."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class CallError:
    message: str


def has_call(text: str) -> bool:
    return OPEN in text


def parse_calls(text: str) -> list[ToolCall | CallError]:
    """Every ``<tool_call>`` block in ``text``, in order; an unclosed one is a :class:`CallError`."""
    out: list[ToolCall | CallError] = []
    end = 0
    for m in _CALL.finditer(text):
        out.append(_parse_one(m.group(1)))
        end = m.end()
    if OPEN in text[end:]:
        out.append(CallError(f"unclosed {OPEN}: end the call with {CLOSE}"))
    return out


def _parse_one(body: str) -> ToolCall | CallError:
    try:
        obj = json.loads(body)
    except ValueError as exc:
        return CallError(f"tool call is not valid JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return CallError('tool call must be a JSON object {"name": <tool>, "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments JSON-encoded
        try:
            args = json.loads(args)
        except ValueError:
            return CallError("tool call arguments are a string that is not JSON")
    if not isinstance(args, dict):
        return CallError("tool call arguments must be a JSON object")
    return ToolCall(obj["name"], args)
