"""The endpoint's one-tokenizer-call delta (:meth:`ChatRenderer.delta`) against the plain oracle: both
renderings tokenized whole by ``apply_chat_template(tokenize=True)`` and the new one cut after the old one's
last end-of-turn id. Byte-level, ChatML (end of turn is not eos) and BPE-merge tokenizers."""

from __future__ import annotations

import pytest
from unirl_agentic.agent_sessions import ChatRenderer, canonical
from unirl_agentic.examples.calc_agent import TOOLS

from unirl.api import build_chat_demo_tokenizer, build_demo_tokenizer, build_word_demo_tokenizer


def oracle(r: ChatRenderer, served, messages, tools):
    def ids(m, gen):
        return list(r.tokenizer.apply_chat_template(m, tools=tools, tokenize=True, add_generation_prompt=gen,
                                                    return_dict=False, chat_template=r.template))

    old = ids(served, False)
    cut = len(old) - old[::-1].index(r.eot)
    new = ids(messages, True)
    return new[cut:] if new[:cut] == old[:cut] else None


def call(expr: str) -> dict:
    return {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": f'{{"expression": "{expr}"}}'}}


CONVERSATION = [
    {"role": "system", "content": "You multiply."},
    {"role": "user", "content": "Q: 3*7=? A:"},
    {"role": "assistant", "content": "", "tool_calls": [call("3*7")]},
    {"role": "tool", "tool_call_id": "c", "content": "21"},
    {"role": "assistant", "content": " twenty one, check"},
    {"role": "user", "content": "again with words: multiply multiply"},
    {"role": "assistant", "content": "multiply"},
    {"role": "tool", "tool_call_id": "c", "content": "error: only integers"},
]


@pytest.mark.parametrize("build", [build_demo_tokenizer, build_chat_demo_tokenizer,
                                   lambda: build_word_demo_tokenizer(["multiply", "words", "again"], 300)],
                         ids=["bytes", "chatml", "bpe"])
def test_delta_equals_the_whole_renderings_cut_after_the_last_turn(build):
    r = ChatRenderer(build())
    msgs = canonical(CONVERSATION)
    checked = 0
    for tools in (TOOLS, None):
        for a in (i for i, m in enumerate(msgs) if m["role"] == "assistant"):
            for end in range(a + 2, len(msgs) + 1):
                want = oracle(r, msgs[:a + 1], msgs[:end], tools)
                assert want is not None and want  # the oracle sees an extension here
                assert r.delta(msgs[:a + 1], msgs[:end], tools) == want
                checked += 1
    assert checked == 2 * (5 + 3 + 1)
    edited = [dict(msgs[0], content="You add."), *msgs[1:4]]  # an earlier message changed: a break
    assert oracle(r, msgs[:3], edited, TOOLS) is None and r.delta(msgs[:3], edited, TOOLS) is None
    assert r.ids(msgs[:2], TOOLS, gen=True) == list(r.tokenizer.apply_chat_template(
        msgs[:2], tools=TOOLS, tokenize=True, add_generation_prompt=True, return_dict=False,
        chat_template=r.template))
