"""Agent sessions: the token-identity rule between an agent's message lists and a trajectory's tokens.

An agent sends the whole conversation with every request. Re-rendering it through the chat template and
re-tokenizing the earlier assistant turns would change their ids (a BPE merge across a boundary, a
template that drops reasoning, a JSON re-serialised with other spaces), and the trainer would then train
on tokens that were never sampled. So a session keeps the trajectory it has served:

* a request whose messages **extend** the conversation served so far (same messages, same tools, the
  assistant turns exactly as returned) continues that trajectory: the earlier turns stay the sampled
  ids, and only the new messages are rendered and tokenized (the template's delta after the last
  end-of-turn token), appended as one observation Part (loss mask 0);
* any other request (an edited or truncated history, other tools) **branches**: a new trajectory
  starts from the rendered request, and the break is counted (``agent/prefix_breaks``). The last branch
  is the one trained on (its reward is the agent's); earlier ones are dropped, never merged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from unirl.api import Sample, end_of_turn_id

#: the chat template used when the tokenizer has none (the byte-level demo tokenizers): tools named on
#: one line, messages as plain text, an assistant turn closed by eos, a tool result as a tagged turn. Short
#: on purpose: a tiny byte-level model pays per character.
PLAIN_TOOLS_TEMPLATE = (
    "{%- if tools %}tools: {% for t in tools %}{{ t.function.name if t.function is defined else t.name }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}{{ '\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{ m.content }}{{ '\\n' }}"
    "{%- elif m.role == 'user' %}{{ m.content }}"
    "{%- elif m.role == 'assistant' %}{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.call_json }}</tool_call>{% endfor %}"
    "{{ eos_token }}"
    "{%- elif m.role == 'tool' %}{{ '\\n' }}<tool_response>{{ m.content }}</tool_response>{{ '\\n' }}"
    "{%- endif %}{%- endfor %}"
)


class RenderError(ValueError):
    """A message list the template cannot render (the server answers 400)."""


def canonical(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages reduced to what the template renders, so the client's own echo of an assistant message
    (with ``refusal: null``, ``annotations: []``, a re-serialised ``arguments`` string) compares equal to
    what the server returned. Arguments become parsed JSON (what chat templates expect)."""
    out = []
    for k, m in enumerate(messages, 1):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RenderError(f"messages[{k - 1}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones, joined
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        c: dict[str, Any] = {"role": m["role"], "content": "" if content is None else str(content)}
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fn = (tc or {}).get("function") or {}
                args = fn.get("arguments", "{}")
                try:
                    parsed = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    parsed = args
                name = fn.get("name", "")
                calls.append({"type": "function", "function": {"name": name, "arguments": parsed},
                              "call_json": json.dumps({"name": name, "arguments": parsed}, separators=(",", ":"))})
            c["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                c[key] = m[key]
        out.append(c)
    return out


class ChatRenderer:
    """The template (the tokenizer's own, else :data:`PLAIN_TOOLS_TEMPLATE`) and its end-of-turn token."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        own = getattr(tokenizer, "chat_template", None)
        self.template = None if own else PLAIN_TOOLS_TEMPLATE
        self.eot = end_of_turn_id(tokenizer) if own else tokenizer.eos_token_id
        if self.eot is None:
            raise ValueError("the tokenizer's chat template closes an assistant turn with no special token, so "
                             "a sampled turn cannot be continued; fix: a tokenizer whose template ends turns with "
                             "one (e.g. <|im_end|>)")
        self.eot_text = tokenizer.decode([self.eot], skip_special_tokens=False)

    def text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, gen: bool) -> str:
        """The template's rendering as text (Jinja only: a tokenizer call costs as much again, per request)."""
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=gen, chat_template=self.template)
        except Exception as exc:  # noqa: BLE001 - a Jinja error on the agent's input is the agent's 400
            raise RenderError(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        """What ``apply_chat_template(tokenize=True)`` makes of a rendered text (no special tokens added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, gen: bool) -> list[int]:
        return self.encode(self.text(messages, tools, gen=gen))

    def delta(self, served: list[dict[str, Any]], messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None) -> list[int] | None:
        """The ids the template puts after the last assistant turn of ``served`` (cut after its end-of-turn
        token) when it renders ``messages`` with the generation prompt; None when the two renderings differ
        before that cut (the template renders the earlier turns differently: a break).

        Two Jinja renders and one tokenizer call (not two): the renderings are compared as text up to the
        last end-of-turn string, and the new one is tokenized once. Equal text tokenizes to equal ids, and
        the tokenizer splits at the end-of-turn special token, so the ids agree up to the ``m``-th
        end-of-turn id (``m``: how many the common text holds) and the delta is what follows it."""
        old = self.text(served, tools, gen=False)
        eot = self.eot_text
        k = old.rfind(eot)
        if k < 0:
            return None
        cut = k + len(eot)
        new = self.text(messages, tools, gen=True)
        if not new.startswith(old[:cut]):
            return None
        ids = self.encode(new)
        m, seen = old.count(eot, 0, cut), 0
        for i, t in enumerate(ids):
            if t == self.eot:
                seen += 1
                if seen == m:
                    return ids[i + 1:]
        return None  # the special token did not survive tokenization: treat as a break


@dataclass
class Session:
    """One agent's trajectory slot: the sample it grows, and the conversation served so far."""

    key: str
    slot: Sample  # the generation slot (id, seed, answer); each branch starts from a copy
    sample: Sample | None = None  # the current branch's trajectory
    served: list[dict[str, Any]] = field(default_factory=list)  # canonical messages incl. our replies
    tools: list[dict[str, Any]] | None = None
    branches: int = 0  # prefix breaks: requests that did not extend the conversation
    requests: int = 0
    dropped_tokens: int = 0  # model tokens of abandoned branches
    closed: bool = False

    def extends(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
        n = len(self.served)
        return (self.sample is not None and tools == self.tools and len(messages) > n
                and messages[:n] == self.served)

    def start(self, prompt_ids: list[int], messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Sample:
        """A new branch from ``prompt_ids``: the first request, or after a prefix break."""
        if self.sample is not None:
            self.branches += 1
            self.dropped_tokens += sum(self.sample.loss_mask)
        s = self.slot.copy()
        s.prompt_ids = list(prompt_ids)
        s.meta["agent_branch"] = self.branches
        self.sample, self.served, self.tools = s, list(messages), tools
        return s
