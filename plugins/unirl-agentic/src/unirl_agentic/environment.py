"""``tool_env``: the model calls registered tools over several turns until it answers.

A turn with no ``<tool_call>`` is the final answer (the trajectory ends, the controller scores that
turn's text with ``reward.name``). A turn with calls runs each call and returns their results as one
tool turn (an observation: loss mask 0, appended by the controller with its own token ids, so the
model's tokens are never re-tokenized). After ``max_turns`` model turns the trajectory ends unanswered
(a genuine miss, scored like any other answer).

Re-entrant: all per-trajectory state is keyed by ``sample.id`` under a lock, so one instance serves
every concurrent trajectory. Stateful tools get one session per trajectory, opened at its first call
and always ended by :meth:`ToolEnvironment.close` (which the controller runs on every exit path).
A :class:`~unirl_agentic.tooling.ToolFailure` (timeout, dead session) or a tool that raises ends the
trajectory as an infrastructure failure (``info["failure"]``: reward NaN).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from unirl.api import Environment, EnvStep, Sample, Tool, ToolResult
from unirl_agentic.calls import CallError, ToolCall, has_call, parse_calls
from unirl_agentic.options import AgenticOptions, agentic_options
from unirl_agentic.tooling import StatefulTool, ToolFailure, clean_text

#: how one tool result is rendered as the next turn (``{content}``), per ``plugins.agentic.format``
FORMATS = {
    "plain": "\n<tool_response>{content}</tool_response>\n",
    # Qwen3's chat template: the assistant turn ends, a user turn carries the response, the assistant resumes
    "qwen3": "<|im_end|>\n<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\n",
}


@dataclass
class _Trajectory:
    turns: int = 0
    sessions: set[str] = field(default_factory=set)
    calls: int = 0
    errors: int = 0


class ToolEnvironment(Environment):
    """Parses tool calls, runs tools, renders results; see the module doc."""

    #: stop strings a model turn needs so it ends right after a call (the controller adds them)
    stop: tuple[str, ...] = ("</tool_call>",)

    def __init__(self, *, config: Any = None, tools: dict[str, Tool] | None = None, tokenizer: Any = None,
                 options: AgenticOptions | None = None):
        self.options = options if options is not None else agentic_options(config)
        self.tools = dict(tools or {})
        self.tokenizer = tokenizer
        self.template = FORMATS[self.options.format]
        self._state: dict[str, _Trajectory] = {}
        self._lock = threading.Lock()

    @property
    def stateful(self) -> bool:
        """Whether a trajectory holds state outside its tokens (a tool session): then it cannot be carried
        across a weight sync by replaying tokens alone."""
        return any(isinstance(t, StatefulTool) for t in self.tools.values())

    def live(self) -> list[str]:
        """Trajectories reset and not yet closed (leak checks read this)."""
        with self._lock:
            return list(self._state)

    # ------------------------------------------------------------------ the protocol
    def reset(self, sample: Sample) -> None:
        with self._lock:
            if sample.id in self._state:
                raise ValueError(f"tool_env: trajectory {sample.id} was reset twice without close")
            # a resumed trajectory (a carried tail restored from a checkpoint) continues its counts
            self._state[sample.id] = _Trajectory(turns=sample.turns, calls=sample.meta.get("tool_calls", 0),
                                                 errors=sample.meta.get("tool_errors", 0))

    def step(self, sample: Sample, turn_text: str) -> EnvStep:
        """One environment step; its duration is recorded on the turn it answers
        (``RequestRecord.tool_ms``), so a rollout trace can split the wait before the next turn into
        tool time and controller overhead."""
        t0 = time.perf_counter()
        try:
            return self._step(sample, turn_text)
        finally:
            if sample.requests:
                sample.requests[-1].tool_ms = round((time.perf_counter() - t0) * 1000.0, 3)

    def _step(self, sample: Sample, turn_text: str) -> EnvStep:
        with self._lock:
            st = self._state.get(sample.id)
        if st is None:
            raise ValueError(f"tool_env: step for {sample.id} before reset (or after close)")
        st.turns += 1
        if not has_call(turn_text):
            return EnvStep(done=True, info={"final_answer": turn_text, "turns": st.turns})
        if sample.turns:  # the turn's Parts say what it was (the loss mask is unchanged); a step made
            sample.mark_last_turn("tool_call")  # without an engine turn (a direct call) has none to mark
        results: list[str] = []
        for call in parse_calls(turn_text):
            st.calls += 1
            if isinstance(call, CallError):
                st.errors += 1
                results.append(f"error: {call.message}")
                continue
            try:
                res = self._run(sample.id, st, call)
            except ToolFailure as exc:
                return EnvStep(done=True, info={"failure": f"tool {call.name}: {exc}", "turns": st.turns})
            except Exception as exc:  # noqa: BLE001 - a tool bug is an infrastructure fault, not a miss
                return EnvStep(done=True, info={"failure": f"tool {call.name} raised {type(exc).__name__}: {exc}",
                                                "turns": st.turns})
            error = bool(getattr(res, "error", False))
            if error:
                st.errors += 1
            results.append(("error: " if error else "") + clean_text(getattr(res, "content", res)))
        sample.meta["tool_calls"], sample.meta["tool_errors"] = st.calls, st.errors
        if st.turns >= self.options.max_turns:
            return EnvStep(done=True, info={"final_answer": "", "max_turns": True, "turns": st.turns})
        return EnvStep(observation=self.template.format(content="\n".join(results)), info={"turns": st.turns})

    def close(self, sample: Sample) -> None:
        with self._lock:
            st = self._state.pop(sample.id, None)
        if st is None:
            return
        for name in st.sessions:
            tool = self.tools[name]
            assert isinstance(tool, StatefulTool)
            tool.session_end(sample.id)

    # ------------------------------------------------------------------ tools
    def _run(self, sid: str, st: _Trajectory, call: ToolCall) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolResult(f"unknown tool {call.name!r} (tools: {known})", error=True)
        if isinstance(tool, StatefulTool):
            if call.name not in st.sessions:
                tool.session_start(sid)
                st.sessions.add(call.name)
            return tool.execute(sid, call.arguments)
        return tool.call(call.arguments)


def render_call(name: str, arguments: dict[str, Any]) -> str:
    """The exact text of a tool call as the parser reads it (SFT traces and docs use it)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")) + "</tool_call>"
