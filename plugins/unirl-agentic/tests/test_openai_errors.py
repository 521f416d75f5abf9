"""Malformed requests to the agent endpoint get OpenAI-format errors (status, ``error.message``,
``error.type``), one test per case, over real HTTP (httpx, and the openai client's own exception types)."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from agentic_support import prompts
from unirl_agentic.engine_bridge import EngineBridge
from unirl_agentic.openai_server import AgentServer

from unirl.api import SamplingParams


@pytest.fixture(scope="module")
def served(engine, tok):
    bridge = EngineBridge(engine)
    server = AgentServer(bridge, tok, max_prompt_tokens=24)
    server.start()
    stop = threading.Event()
    pump = threading.Thread(target=bridge.pump, args=(stop.is_set,))
    pump.start()
    sess = server.open_session(prompts(tok, 1)[0].child(0), SamplingParams(max_new_tokens=4, max_response_tokens=16))
    yield server, sess
    stop.set()
    pump.join(30)
    server.close()


def post(server, key, content: bytes | None = None, json=None):
    return httpx.post(f"{server.base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      content=content, json=json, timeout=30)


def error_of(r, status: int, type_: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == type_ and isinstance(err["message"], str) and err["message"]
    return err


def test_bad_json(served):
    server, sess = served
    err = error_of(post(server, sess.key, content=b"{not json"), 400)
    assert "JSON" in err["message"]


def test_missing_model(served):
    server, sess = served
    err = error_of(post(server, sess.key, json={"messages": [{"role": "user", "content": "x"}]}), 400)
    assert err["param"] == "model"


def test_missing_messages(served):
    server, sess = served
    err = error_of(post(server, sess.key, json={"model": server.model}), 400)
    assert err["param"] == "messages"


def test_context_overflow(served):
    server, sess = served
    client = openai.OpenAI(base_url=server.base_url, api_key=sess.key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "x" * 100}])
    assert exc.value.status_code == 400 and exc.value.code == "context_length_exceeded"
    assert "maximum prompt length is 24" in exc.value.message


def test_unknown_session(served):
    server, _ = served
    client = openai.OpenAI(base_url=server.base_url, api_key="unirl-nobody", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "x"}])
    assert exc.value.status_code == 401 and "unknown session" in exc.value.message


def test_unknown_model_and_streaming(served):
    server, sess = served
    msgs = [{"role": "user", "content": "x"}]
    assert error_of(post(server, sess.key, json={"model": "gpt-4o", "messages": msgs}), 404)["code"] == "model_not_found"
    assert error_of(post(server, sess.key, json={"model": server.model, "messages": msgs, "stream": True}),
                    400)["param"] == "stream"


def test_models_and_a_path_prefix_session(served):
    server, sess = served
    base = server.base_url.removesuffix("/v1") + f"/s/{sess.key}/v1"
    client = openai.OpenAI(base_url=base, api_key="ignored", max_retries=0)
    assert [m.id for m in client.models.list()] == [server.model]
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}])
    assert r.model_extra["unirl"]["token_ids"] == sess.sample.response_ids
