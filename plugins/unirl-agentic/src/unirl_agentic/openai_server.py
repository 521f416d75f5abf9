"""An OpenAI-compatible Chat Completions endpoint on localhost, backed by the run's rollout engine.

``POST /v1/chat/completions`` (non-streaming) and ``GET /v1/models``, served by aiohttp on a loop thread
of its own. Each trajectory is a session keyed by its API key (``Authorization: Bearer <key>``), or by a
path prefix (``/s/<key>/v1/...``) for clients that cannot set one, so concurrent agents never mix. The
token-identity rule (:mod:`unirl_agentic.agent_sessions`) decides what each request appends; the engine
is reached only through :class:`~unirl_agentic.engine_bridge.EngineBridge`. Errors use the OpenAI
format (``{"error": {"message", "type", "param", "code"}}``) with the status a client expects.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from unirl.api import SamplingParams
from unirl_agentic.agent_sessions import ChatRenderer, RenderError, Session, canonical
from unirl_agentic.engine_bridge import EngineBridge
from unirl_agentic.tool_parsers import tool_parser


class ApiError(Exception):
    """An OpenAI-format error response."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", *,
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status)


@dataclass
class ServerStats:
    prefix_breaks: int = 0
    errors: int = 0
    requests: int = 0


class AgentServer:
    """Sessions, the request handlers and the server's loop thread (started by :meth:`start`)."""

    def __init__(self, bridge: EngineBridge, tokenizer: Any, *, model: str = "unirl-policy",
                 tool_parser_name: str = "qwen3", max_prompt_tokens: int | None = None):
        self.bridge, self.tokenizer, self.model = bridge, tokenizer, model
        self.renderer = ChatRenderer(tokenizer)
        self.parse = tool_parser(tool_parser_name)
        self.max_prompt_tokens = max_prompt_tokens
        self.sessions: dict[str, Session] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.sampling: dict[str, SamplingParams] = {}  # per session: the drive's sampling
        self.stats = ServerStats()
        self._id_prefix, self._ids = uuid.uuid4().hex[:12], itertools.count()  # unique ids, no urandom a request
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    # ------------------------------------------------------------------ lifecycle
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        if self._thread is not None:
            return
        ready = threading.Event()
        self.loop = asyncio.new_event_loop()

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self._serve())
            ready.set()
            self.loop.run_forever()

        self._thread = threading.Thread(target=main, name="agent-server", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the agent endpoint did not start within 30 s")

    async def _serve(self) -> None:
        app = web.Application(client_max_size=64 * 2**20)
        for prefix in ("", "/s/{key}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_get(prefix + "/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # port 0: the OS picked a free one

    def run(self, coro: Any) -> Any:
        """Run ``coro`` on the server's loop; returns a concurrent future."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        if self._thread is None or self.loop is None:
            return
        if self._runner is not None:
            self.run(self._runner.cleanup()).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()
        self._thread = None

    # ------------------------------------------------------------------ sessions
    def open_session(self, slot: Any, sampling: SamplingParams) -> Session:
        key = f"unirl-{uuid.uuid4().hex}"
        s = self.sessions[key] = Session(key, slot)
        self.sampling[key] = sampling
        return s

    def close_session(self, key: str) -> Session:
        s = self.sessions.pop(key)
        self.sampling.pop(key, None)
        self._locks.pop(key, None)
        s.closed = True
        return s

    def _session(self, request: web.Request) -> Session:
        key = request.match_info.get("key")
        if key is None:
            auth = request.headers.get("Authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        s = self.sessions.get(key)
        if s is None:
            raise ApiError(401, "unknown session: this API key names no open trajectory (each agent gets its own "
                           "key; a trajectory's session ends when its agent returns)", code="invalid_api_key")
        return s

    # ------------------------------------------------------------------ handlers
    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except ApiError as e:
            return e.response()
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "unirl"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        self.stats.requests += 1
        try:
            session = self._session(request)
            body = await self._body(request)
            lock = self._locks.setdefault(session.key, asyncio.Lock())
            async with lock:  # one request of a session at a time: a trajectory is one stream
                return web.json_response(await self._complete(session, body))
        except ApiError as e:
            self.stats.errors += 1
            return e.response()

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            raise ApiError(400, f"could not parse the JSON body of your request: {exc}") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if not body.get("model"):
            raise ApiError(400, "you must provide a model parameter", param="model")
        if body["model"] != self.model:
            raise ApiError(404, f"the model {body['model']!r} does not exist; this endpoint serves {self.model!r} "
                           "(GET /v1/models)", param="model", code="model_not_found")
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' is a required property: a non-empty array of messages", param="messages")
        if body.get("stream"):
            raise ApiError(400, "stream: true is not supported by this endpoint; send stream: false", param="stream")
        if body.get("n", 1) != 1:
            raise ApiError(400, "only n: 1 is supported (each trajectory is one stream)", param="n")
        return body

    async def _complete(self, session: Session, body: dict[str, Any]) -> dict[str, Any]:
        try:
            msgs, tools = canonical(body["messages"]), body.get("tools") or None
        except RenderError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        sampling = self.sampling[session.key]
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(cap, int) and cap > 0:
            sampling = replace(sampling, max_new_tokens=min(cap, sampling.max_new_tokens))
        try:
            sample = self._extend(session, msgs, tools, sampling)
        except RenderError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        mark, prompt_tokens = len(sample.response_ids), sample.num_tokens
        session.requests += 1
        done = await self.bridge.generate(sample, sampling)
        if session.closed:
            raise ApiError(401, "the session ended while its request ran", code="invalid_api_key")
        if done.status == "failed":
            raise ApiError(500, f"the engine failed this request: {done.meta.get('error', '')}", "server_error")
        ids = done.response_ids[mark:]
        body_ids = ids[:-1] if ids and ids[-1] == self.renderer.eot else ids
        parsed = self.parse(self.tokenizer.decode(body_ids, skip_special_tokens=False))
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content or (None if parsed.tool_calls else "")}
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        session.served = [*msgs, *canonical([message])]
        finish = "tool_calls" if parsed.tool_calls and done.finish_reason == "stop" else done.finish_reason
        return {
            "id": f"chatcmpl-{self._id_prefix}{next(self._ids)}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                      "total_tokens": prompt_tokens + len(ids)},
            # not in the OpenAI schema (clients keep it in model_extra): what was sampled, for audits
            "unirl": {"token_ids": ids, "logprobs": done.rollout_logprobs[mark:], "versions": done.versions[mark:],
                      "branch": session.branches},
        }

    def _extend(self, session: Session, msgs: list[dict[str, Any]], tools: Any, sampling: SamplingParams) -> Any:
        """Continue the session's trajectory with the new messages, or start a branch (module doc)."""
        delta = self.renderer.delta(session.served, msgs, tools) if session.extends(msgs, tools) else None
        if delta is None:
            if session.sample is not None:
                self.stats.prefix_breaks += 1
            ids = self.renderer.ids(msgs, tools, gen=True)
            if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                raise ApiError(400, f"this model's maximum prompt length is {self.max_prompt_tokens} tokens; your "
                               f"messages render to {len(ids)}", param="messages", code="context_length_exceeded")
            session.start(ids, msgs, tools)
        else:
            s = session.sample
            closed = bool(s.response_ids) and s.response_ids[-1] == self.renderer.eot
            obs = ([] if closed else [self.renderer.eot]) + delta
            cap = sampling.max_response_tokens
            if cap is not None and len(s.response_ids) + len(obs) >= cap:
                raise ApiError(400, f"this model's maximum context length is {cap} response tokens; the "
                               f"conversation would need {len(s.response_ids) + len(obs) + 1}", param="messages",
                               code="context_length_exceeded")
            s.append_observation(obs, text=self.tokenizer.decode(obs, skip_special_tokens=False))
            session.served = list(msgs)
        if sampling.new_token_limit(session.sample) <= 0:
            raise ApiError(400, "this model's maximum context length is reached: no tokens left to generate",
                           param="messages", code="context_length_exceeded")
        return session.sample
