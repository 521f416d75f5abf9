"""Running user agents: ``async def run(client: openai.AsyncOpenAI, task: dict) -> float | dict``.

Why the agent owns its loop: agent builders write against the OpenAI API, with their own control flow
and their own tools; UniRL only hands each one a client whose ``base_url`` and key point at its
trajectory's session. An agent that raises or runs past ``agent_timeout_s`` fails its own trajectory
(reward NaN, excluded from its group like any failed sample), never the drive.
"""

from __future__ import annotations

import asyncio
import importlib
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

Agent = Callable[[Any, dict[str, Any]], Awaitable[Any]]


def load_agent(spec: str) -> Agent:
    """``"my_pkg.my_agent:run"`` -> the coroutine function (a one-line error naming the field otherwise)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"plugins.agentic.agent: {spec!r} is not 'module:function' (e.g. my_pkg.my_agent:run)")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"plugins.agentic.agent: cannot load {spec!r} ({type(exc).__name__}: {exc}); fix: an "
                         "importable module (on PYTHONPATH) and the name of its async function") from exc
    if not asyncio.iscoroutinefunction(fn):
        raise ValueError(f"plugins.agentic.agent: {spec!r} is not an async function; fix: "
                         "async def run(client, task) -> float | dict")
    return fn


@dataclass
class AgentResult:
    """What one agent run came to: a reward (NaN when it failed), its metrics, and why it failed."""

    reward: float = math.nan
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    timed_out: bool = False


def result_of(value: Any) -> AgentResult:
    """A float reward, or ``{"reward": float, "metrics": {...}}`` (other numeric keys count as metrics)."""
    if isinstance(value, dict):
        if "reward" not in value:
            return AgentResult(error="the agent returned a dict without 'reward'")
        metrics = dict(value.get("metrics") or {})
        metrics.update({k: v for k, v in value.items() if k not in ("reward", "metrics")
                        and isinstance(v, int | float) and not isinstance(v, bool)})
        value = value["reward"]
    else:
        metrics = {}
    try:
        reward = float(value)
    except (TypeError, ValueError):
        return AgentResult(error=f"the agent returned {type(value).__name__}, not a reward (float | dict)")
    if not math.isfinite(reward):
        return AgentResult(error=f"the agent returned reward {reward}")
    return AgentResult(reward, {k: float(v) for k, v in metrics.items()})


async def run_agent(agent: Agent, client: Any, task: dict[str, Any], timeout_s: float,
                    gate: asyncio.Semaphore, tracker: Any = None, close_client: bool = False,
                    key: str = "") -> AgentResult:
    """One agent under the concurrency gate and its timeout (``close_client``: close it afterwards). ``tracker``
    (the engine bridge) is told when the agent starts and ends, so it can batch the live agents' turns."""
    async with gate:
        if tracker is not None:
            tracker.agent_started()
        try:
            return result_of(await asyncio.wait_for(agent(client, task), timeout_s))
        except TimeoutError:
            return AgentResult(error=f"the agent ran past plugins.agentic.agent_timeout_s = {timeout_s} s",
                               timed_out=True)
        except Exception as exc:  # noqa: BLE001 - an agent's bug fails its trajectory only
            return AgentResult(error=f"the agent raised {type(exc).__name__}: {exc}"[:500])
        finally:
            if tracker is not None:
                tracker.agent_ended(key)
            if close_client:
                try:
                    await client.close()
                except Exception:  # noqa: BLE001, S110 - closing a client must not fail the result
                    pass
