"""The SDK transform's fast path (unirl_agentic.sdk_fastpath) returns exactly what the openai SDK's own
``async_maybe_transform`` returns, on the shapes agents send and on the ones it must hand back to the SDK
(pydantic messages, tuples, generators, omitted nested values, aliased keys)."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Required

from openai import omit
from openai._utils._transform import PropertyInfo, async_maybe_transform
from openai.types.chat import ChatCompletionMessage, completion_create_params
from typing_extensions import TypedDict
from unirl_agentic import sdk_fastpath
from unirl_agentic.examples import calc_agent

PARAMS = completion_create_params.CompletionCreateParamsNonStreaming
CALL = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "3*7"}'}}


def both(data, expected=PARAMS):
    """(the SDK's result, the fast path's); ``data`` may be a factory (a generator is consumed once)."""
    make = data if callable(data) else lambda: data

    async def go():
        return (await async_maybe_transform(make(), expected),
                await sdk_fastpath.fast_async_maybe_transform(make(), expected))
    sdk_fastpath.install()
    return asyncio.run(go())


def body(messages, **kw):
    return {"model": "unirl-policy", "messages": messages, "stream": False, "temperature": omit, "tools": omit,
            "max_tokens": omit, **kw}


def test_plain_conversations_equal_the_sdk_transform():
    user = {"role": "user", "content": "Q: 3*7=? A:"}
    cases = [
        body([user]),
        body([user, {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_0", "content": "21"}], tools=calc_agent.TOOLS),
        body([{"role": "system", "content": "be brief"},
              {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url",
                                            "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
             max_tokens=8, temperature=0.5, stop=["\n"], logit_bias={"1": -100}, seed=3),
        body([user], tools=calc_agent.TOOLS, tool_choice={"type": "function", "function": {"name": "calculator"}},
             response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
    ]
    for data in cases:
        sdk, fast = both(data)
        assert fast == sdk and json.dumps(fast) == json.dumps(sdk)  # the same body, key order included
        assert "temperature" not in fast or data["temperature"] is not omit


def test_what_is_not_plain_json_goes_to_the_sdk():
    """Each of these is transformed by the SDK (a model dumped, a tuple or generator listed, an omitted
    nested value dropped): the fast path must not take it, so the results still equal."""
    model_msg = ChatCompletionMessage.model_validate({"role": "assistant", "content": "21"})
    user = {"role": "user", "content": "Q"}
    cases = [body([user, model_msg]), body((user,)), lambda: body(m for m in [user]),
             body([{"role": "user", "content": "Q", "name": omit}])]
    for data in cases:
        sdk, fast = both(data)
        assert fast == sdk and len(sdk["messages"]) >= 1, (data, fast, sdk)
    assert both(body([user, model_msg]))[1]["messages"][1] == {"role": "assistant", "content": "21"}


class Inner(TypedDict, total=False):
    card_id: Required[Annotated[str, PropertyInfo(alias="cardID")]]


class Outer(TypedDict, total=False):
    items: list[Inner]


def test_an_aliased_key_is_renamed_as_the_sdk_does():
    assert not sdk_fastpath.alias_free(Outer) and sdk_fastpath.alias_free(PARAMS)
    sdk, fast = both({"items": [{"card_id": "x"}]}, Outer)
    assert fast == sdk == {"items": [{"cardID": "x"}]}


def test_install_patches_the_chat_completions_module_once():
    from openai.resources.chat.completions import completions

    assert sdk_fastpath.install() and sdk_fastpath.install()
    assert completions.async_maybe_transform is sdk_fastpath.fast_async_maybe_transform


def test_a_primed_client_sends_the_platform_headers_it_would_compute():
    import openai
    from openai._base_client import get_platform

    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="k")
    assert client._platform is None  # the SDK computes it on a worker thread before the first request
    sdk_fastpath.prime_platform(client)
    assert client._platform == get_platform()
    assert client.default_headers["X-Stainless-OS"] == str(get_platform())
