"""Multi-turn tool-use rollouts for UniRL: the ``tool_env`` environment, the ``calculator`` and
``python_sandbox`` tools, and :class:`~unirl_agentic.controller.AgenticRolloutController`.

Light at import (no torch): the heavy modules load when used."""

from unirl_agentic.options import SECTION, AgenticOptions

__all__ = ["SECTION", "AgenticOptions"]
