"""What the plugin adds to core's :class:`~unirl.contracts.Tool`: sessions, and the failure that is
not the model's fault.

* :class:`StatefulTool`: a tool that keeps state for one trajectory (a Python interpreter, a shell).
  The environment opens one session per trajectory at ``reset`` and always ends it at ``close``.
* :class:`ToolFailure`: raised by a tool when the *infrastructure* failed (a timeout, a killed
  process), as opposed to an error in the call, which is returned as ``ToolResult(error=True)`` and
  shown to the model. A failure ends the trajectory with reward NaN: it is excluded from its group,
  never scored as a miss.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from unirl.api import Tool, ToolResult


def clean_text(text: object) -> str:
    """Any tool output made safe to show the model and to tokenize: ``str`` of it, lone surrogates escaped
    (``\\ud800``). Why: ``print('\\ud800')`` in the sandbox once raised ``UnicodeEncodeError`` in the
    tokenizer, out of ``collect()``, and aborted the whole drive."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")


class ToolFailure(Exception):
    """The tool could not run (timeout, crashed worker): an infrastructure fault, not a wrong call."""


class StatefulTool(Tool):
    """A tool with per-trajectory sessions. ``call`` runs a one-shot session (stateless use)."""

    @abstractmethod
    def session_start(self, session_id: str) -> None:
        """Open the session ``session_id`` (one per trajectory)."""

    @abstractmethod
    def execute(self, session_id: str, arguments: dict[str, Any]) -> ToolResult:
        """Run one call in the session; raise :class:`ToolFailure` if the session itself died."""

    @abstractmethod
    def session_end(self, session_id: str) -> None:
        """Release everything the session holds. Idempotent; never raises."""

    @abstractmethod
    def live_sessions(self) -> list[str]:
        """Sessions open now (what a leak check and the reclaimer read)."""

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        sid = f"oneshot-{id(arguments)}"
        self.session_start(sid)
        try:
            return self.execute(sid, arguments)
        finally:
            self.session_end(sid)
