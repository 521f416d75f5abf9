"""``rollout.controller: openai_agent``: bring your own agent, written against the OpenAI API.

Per collect, every generation slot (``groups`` prompts x ``n``) becomes a session on the localhost
endpoint (:mod:`unirl_agentic.openai_server`) and one run of the user's agent
(``plugins.agentic.agent``: ``async def run(client: openai.AsyncOpenAI, task: dict) -> float | dict``)
with a client keyed to it; ``plugins.agentic.concurrency`` agents run at once. The agents and the
server share one asyncio loop thread; the calling (trainer) thread pumps the engine
(:class:`~unirl_agentic.engine_bridge.EngineBridge`) until every agent has returned and nothing of
ours is in flight, so the trainer may sync weights when :meth:`collect` returns. Each session's
trajectory (the last branch, see :mod:`unirl_agentic.agent_sessions`) is scored with the agent's reward;
an agent that raises or times out fails only its trajectory.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from unirl.api import (
    ControllerCapabilities,
    RolloutController,
    RolloutEngine,
    RunConfig,
    Sample,
    SamplingParams,
    expand,
)
from unirl_agentic import sdk_fastpath
from unirl_agentic.agent_runner import Agent, AgentResult, load_agent, run_agent
from unirl_agentic.agent_sessions import ChatRenderer, canonical
from unirl_agentic.engine_bridge import EngineBridge
from unirl_agentic.openai_server import AgentServer
from unirl_agentic.options import agentic_options

#: ``demonstration(task, expert) -> (messages, tools)``: an agent module's SFT warm-start conversation
Demonstration = Callable[[dict[str, Any], bool], tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]


def task_of(slot: Sample) -> dict[str, Any]:
    """The dataset row an agent gets: the prompt text, the reference answer, the sample id and meta."""
    return {"id": slot.id, "prompt": slot.prompt_text, "answer": slot.answer, "meta": dict(slot.meta)}


class OpenAIAgentController(RolloutController):
    @classmethod
    def capabilities(cls, config: RunConfig) -> ControllerCapabilities:
        """Multi-turn (the agent's own loop behind an OpenAI endpoint); it runs no ``rollout.environment``."""
        return ControllerCapabilities(drives_environments=False, multi_turn=True)

    def __init__(self, engine: RolloutEngine, tokenizer: Any, agent: Agent, *, tag: str = "agent",
                 base_seed: int | None = None, repeat_seeds: bool = False, concurrency: int = 64,
                 timeout_s: float = 600.0, tool_parser: str = "qwen3", max_prompt_tokens: int | None = None,
                 max_inflight: int = 64, demonstration: Demonstration | None = None, warm_start_share: float = 1.0):
        self.engine, self.tokenizer, self.agent = engine, tokenizer, agent
        self.tag, self.base_seed, self.repeat_seeds = tag, base_seed, repeat_seeds
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.demonstration, self.warm_start_share = demonstration, warm_start_share
        self.bridge = EngineBridge(engine, max_inflight)
        self.server = AgentServer(self.bridge, tokenizer, tool_parser_name=tool_parser,
                                  max_prompt_tokens=max_prompt_tokens)
        self._drive = 0
        self._metrics: dict[str, float] = {}
        self._closed = False
        self._pools: list[Any] = []  # the agents' httpx pools (one per concurrent agent), on the server's loop

    # ------------------------------------------------------------------ the one call
    def collect(self, draw: Callable[[int], list[Sample]], *, groups: int, n: int,
                sampling: SamplingParams, launch_tag: str = "") -> list[Sample]:
        if self._closed:
            raise RuntimeError("OpenAIAgentController is closed")
        if groups < 1 or n < 1:
            raise ValueError(f"collect: groups={groups} and n={n} must both be >= 1")
        self.server.start()
        eot = self.server.renderer.eot
        sampling = replace(sampling, stop_token_ids=tuple(dict.fromkeys((*sampling.stop_token_ids, eot))))
        self._drive += 1
        prompts = list(draw(groups))[:groups]
        tag = launch_tag or f"{self.tag}{self._drive}"
        slots = expand(prompts, n, tag=tag, base_seed=self.base_seed, seed_tag=self.tag if self.repeat_seeds else None)
        sessions = [self.server.open_session(s, sampling) for s in slots]
        breaks0, errors0, turns0 = self.server.stats.prefix_breaks, self.server.stats.errors, self.bridge.turns
        self.bridge.expect(len(sessions), self.concurrency)
        self.bridge.loop = self.server.loop
        fut = self.server.run(self._run_all(sessions))
        self.bridge.pump(until=fut.done)
        results: list[AgentResult] = fut.result()
        out = [self._finish(sess, res) for sess, res in zip(sessions, results, strict=True)]
        for s in out:
            s.validate(source="openai_agent controller")
        self._metrics = self._drive_metrics(out, results, self.server.stats.prefix_breaks - breaks0,
                                            self.server.stats.errors - errors0, self.bridge.turns - turns0)
        return out

    async def _run_all(self, sessions: list[Any]) -> list[AgentResult]:
        """Every session's agent, each with its own client (its key) on a one-connection, TLS-free pool
        (the endpoint is plain HTTP on localhost), the pools kept across collects. Measured on a loaded
        2-core machine: a default ``AsyncOpenAI`` per agent loads the CA bundle (~0.5 s each: 64 agents
        waited ~30 s for their first request), and one pool shared by 64 agents spends most of the loop's
        time matching requests to connections (httpcore checks every connection for each request). The
        pools are the SDK's own aiohttp transport (``openai.DefaultAioHttpClient``): the agents and the
        server share one loop thread, and httpcore's pure-Python HTTP/1.1 cost ~1.1 ms of CPU a request
        against ~0.5 ms through aiohttp's C parser (2026-12-07)."""
        import openai

        sdk_fastpath.install()  # the SDK's request transform, without its walk where the result is known
        bridge = self.bridge

        async def on_request(request: Any) -> None:  # the bridge waits for turns on their way
            bridge.sent(request.headers.get("authorization", "")[7:])

        async def on_response(response: Any) -> None:
            bridge.answered(response.request.headers.get("authorization", "")[7:])

        hooks = {"request": [on_request], "response": [on_response]}
        while len(self._pools) < min(self.concurrency, len(sessions)):
            self._pools.append(agent_pool(self.timeout_s, hooks))
        free = asyncio.Queue()
        for pool in self._pools:
            free.put_nowait(pool)

        async def one(session: Any) -> AgentResult:
            pool = await free.get()  # at most one agent per pool: also the concurrency gate
            try:
                client = openai.AsyncOpenAI(base_url=self.server.base_url, api_key=session.key, max_retries=0,
                                            timeout=self.timeout_s, http_client=pool)
                sdk_fastpath.prime_platform(client)  # no worker-thread hop before its first request
                return await run_agent(self.agent, client, task_of(session.slot), self.timeout_s, gate, self.bridge,
                                       key=session.key)
            finally:
                free.put_nowait(pool)

        gate = asyncio.Semaphore(self.concurrency)
        return list(await asyncio.gather(*(one(s) for s in sessions)))

    def _finish(self, session: Any, result: AgentResult) -> Sample:
        """The session's trajectory, scored with the agent's reward (or failed with its error)."""
        self.server.close_session(session.key)
        s = session.sample if session.sample is not None else session.slot.copy()
        s.meta.update(agent_requests=session.requests, agent_prefix_breaks=session.branches,
                      agent_dropped_tokens=session.dropped_tokens)
        if result.metrics:
            s.meta["agent_metrics"] = dict(result.metrics)
        if result.error is not None:
            s.mark_failed(result.error)
        elif session.sample is None:
            s.mark_failed("the agent returned without a request to the endpoint: nothing was sampled")
        elif s.status != "failed":
            s.reward = result.reward
        s.meta["version"] = self.engine.weight_version
        s.meta["min_version"] = min((v for v in s.versions if v >= 0), default=-1)
        if s.status == "pending":
            s.mark_failed("trajectory ended before any model turn")
        return s

    @staticmethod
    def _drive_metrics(out: list[Sample], results: list[AgentResult], breaks: int, errors: int,
                       turns: int) -> dict[str, float]:
        n = max(len(out), 1)
        m = {"agent/prefix_breaks": float(breaks), "agent/request_errors": float(errors),
             "agent/failed": float(sum(s.failed for s in out)),
             "agent/timeouts": float(sum(r.timed_out for r in results)),
             "agent/mean_turns": sum(s.turns for s in out) / n, "agent/engine_turns": float(turns)}
        keys = {k for r in results for k in r.metrics}
        for k in sorted(keys):
            vals = [r.metrics[k] for r in results if k in r.metrics and math.isfinite(r.metrics[k])]
            if vals:
                m[f"agent/{k}"] = sum(vals) / len(vals)
        return m

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    # ------------------------------------------------------------------ warm start
    def warm_start_samples(self, prompts: list[Sample]) -> list[Sample]:
        """SFT traces from the agent module's ``demonstration(task, expert)`` conversations, rendered the
        way the endpoint renders a session (the same template, the same deltas, so SFT teaches exactly the
        tokens a rollout continues). ``warm_start_tool_share`` of each batch is expert, spread evenly."""
        if self.demonstration is None:
            raise ValueError("plugins.agentic.warm_start: agent needs a demonstration(task, expert) -> (messages, "
                             "tools) function next to the agent; fix: add one, or set sft.steps: 0")
        share = self.warm_start_share
        renderer = self.server.renderer
        out = []
        for i, p in enumerate(prompts):
            expert = math.floor((i + 1) * share) > math.floor(i * share)
            messages, tools = self.demonstration(task_of(p), expert)
            out.append(render_trace(renderer, p.child(0), canonical(messages), tools))
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pool in self._pools:
            self.server.run(pool.aclose()).result(30)
        self.server.close()


def agent_pool(timeout_s: float, hooks: dict[str, list[Any]]) -> Any:
    """One agent's HTTP pool: the openai SDK's aiohttp transport (openai >= 1.89, where its ``aiohttp`` extra
    or vendored copy is present), else plain httpx (same behaviour, more CPU a request)."""
    import openai

    try:
        return openai.DefaultAioHttpClient(verify=False, timeout=timeout_s, event_hooks=hooks)  # noqa: S501 - http
    except (AttributeError, RuntimeError):  # an older SDK, or one installed without its aiohttp transport
        import httpx

        return httpx.AsyncClient(verify=False, timeout=timeout_s, event_hooks=hooks)  # noqa: S501 - plain http


def render_trace(renderer: ChatRenderer, slot: Sample, msgs: list[dict[str, Any]], tools: Any) -> Sample:
    """A demonstration conversation as a trajectory: assistant turns are model Parts (loss mask 1), the
    messages between them observation Parts, each cut exactly as the endpoint cuts a session."""
    first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    s = slot
    s.prompt_ids = renderer.ids(msgs[:first], tools, gen=True)
    context = list(s.prompt_ids)
    for i in range(first, len(msgs)):
        if msgs[i]["role"] != "assistant":
            continue
        if i > first:
            ctx = renderer.ids(msgs[:i], tools, gen=True)
            if ctx[:len(context)] != context:
                raise ValueError("the template renders the earlier turns differently once a later turn follows")
            s.append_observation(ctx[len(context):])
            context = ctx
        full = renderer.ids(msgs[:i + 1], tools, gen=False)
        cut = len(full) - full[::-1].index(renderer.eot)
        ids = full[len(context):cut]
        role = "tool_call" if msgs[i].get("tool_calls") else "model"
        s.append_model_turn(ids, [-1.0] * len(ids), 0, "stop", role=role)  # log-probs unused by SFT
        context = full[:cut]
    return s


class KernelOpenAIAgentController(OpenAIAgentController):
    """``rollout.controller: openai_agent`` as the trainer builds it, from ``plugins.agentic``."""

    def __init__(self, *, config: RunConfig, engine: RolloutEngine, tokenizer: Any, reward_fn: Any,
                 kernel: Any, tag: str = "train", base_seed: int | None = None):
        o = agentic_options(config)
        if not o.agent:
            raise ValueError("rollout.controller: openai_agent needs plugins.agentic.agent (module:function)")
        demo = None
        if o.warm_start == "agent":
            module = o.agent.partition(":")[0]
            import importlib

            demo = getattr(importlib.import_module(module), "demonstration", None)
        super().__init__(engine, tokenizer, load_agent(o.agent), tag=tag, base_seed=base_seed,
                         repeat_seeds=tag == "eval", concurrency=o.concurrency, timeout_s=o.agent_timeout_s,
                         tool_parser=o.tool_parser, max_prompt_tokens=config.data.max_prompt_tokens,
                         max_inflight=o.max_inflight_requests, demonstration=demo,
                         warm_start_share=o.warm_start_tool_share)
