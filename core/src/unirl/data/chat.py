"""Policy prompts through the tokenizer's chat template (``data.chat_template``).

Why here and not in each engine or controller: what the policy sees must be the same token ids in the
prompt, in every later turn of an agentic trajectory, in evaluation and in the stop set. One module
renders them all with the tokenizer's own Jinja template (``apply_chat_template``), so an instruct model
is trained on the format it was tuned on, and a multi-turn trajectory is token for token the
conversation the template would render.
"""

from __future__ import annotations

import functools
from typing import Any

#: the stand-in turns the delta of a later turn is rendered against (:func:`chat_turn_ids`)
_PROBE_USER, _PROBE_ASSISTANT = "probe question", "probe answer"


#: the roles a dataset's chat-message-list prompt may use (the ones chat templates know)
ROLES = ("system", "user", "assistant", "tool")


def message_list_problem(value: Any) -> str | None:
    """Why ``value`` is not a chat-message-list prompt (None: it is one).

    The conversational prompt format of TRL and verl: a non-empty list of ``{"role", "content"}``
    mappings, roles from :data:`ROLES`, string contents, ending on a user or tool turn (the policy
    answers next)."""
    if not isinstance(value, list | tuple) or not value:
        return "must be a non-empty list of chat messages"
    for k, m in enumerate(value, 1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f"message {k} must be a mapping with 'role' and 'content', got {str(m)[:60]}"
        if m["role"] not in ROLES:
            return f"message {k} has role {m['role']!r}; roles: {', '.join(ROLES)}"
        if not isinstance(m["content"], str):
            return f"message {k}'s content must be a string, got {type(m['content']).__name__}"
    if value[-1]["role"] not in ("user", "tool"):
        return f"the last message is a {value[-1]['role']!r} turn; a prompt ends on a user (or tool) turn"
    return None


def last_user_text(conversation: list[dict[str, str]]) -> str:
    """The content of the last user turn: a message-list prompt's ``prompt_text`` (what rewards read)."""
    return next((m["content"] for m in reversed(conversation) if m["role"] == "user"), conversation[-1]["content"])


def messages(prompt: str | list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    """The conversation of a prompt: a text as one user turn, or a message list as given; either after
    ``system_prompt``'s system turn unless the list opens with its own."""
    turns = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
             else [{"role": m["role"], "content": m["content"]} for m in prompt])
    head = [{"role": "system", "content": system_prompt}] if system_prompt and turns[0]["role"] != "system" else []
    return [*head, *turns]


def render(tokenizer: Any, conversation: list[dict[str, str]], *, generation_prompt: bool) -> list[int]:
    """The template's token ids for ``conversation`` (a list, whatever ``apply_chat_template`` returns)."""
    out = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=generation_prompt,
                                        return_dict=False)
    return list(out)


def chat_prompt_ids(tokenizer: Any, text: str | list[dict[str, str]],
                    system_prompt: str | None = None) -> tuple[list[int], str]:
    """A prompt (a text as one user turn, or a chat-message list) after an optional system turn, plus
    the generation prompt: the ids and the rendered text."""
    conversation = messages(text, system_prompt)
    text_out = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return render(tokenizer, conversation, generation_prompt=True), text_out


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The special token the template closes an assistant turn with (``<|im_end|>``, ``<|eot_id|>``...),
    or None when it closes turns with plain text or with nothing.

    Found by rendering a probe conversation: the first token after the assistant's content. Why not a
    table of names: a template is the one source of truth for its own format. Remembered per tokenizer
    and template: every observation turn of an agentic drive and every warm-start batch asks for it."""
    return _end_of_turn_id(tokenizer, repr(getattr(tokenizer, "chat_template", None)))  # a dict of templates too


@functools.lru_cache(maxsize=16)
def _end_of_turn_id(tokenizer: Any, template: str) -> int | None:  # ``template``: part of the cache key
    base = render(tokenizer, [{"role": "user", "content": _PROBE_USER}], generation_prompt=True)
    full = render(tokenizer, [{"role": "user", "content": _PROBE_USER},
                              {"role": "assistant", "content": _PROBE_ASSISTANT}], generation_prompt=False)
    answer = tokenizer.encode(_PROBE_ASSISTANT, add_special_tokens=False)
    if full[: len(base)] != base:
        return None
    rest = full[len(base):]
    for i in range(len(rest) - len(answer) + 1):
        if rest[i : i + len(answer)] == answer:
            after = rest[i + len(answer) : i + len(answer) + 1]
            if after and after[0] in set(tokenizer.all_special_ids) | _added_special(tokenizer):
                return after[0]
            return None
    return None


def response_end_id(tokenizer: Any, chat_template: bool) -> int:
    """The token a finished response ends with: the template's end-of-turn token under
    ``data.chat_template`` (when it has one), else eos. The warm start teaches it and the stop set holds it."""
    eot = end_of_turn_id(tokenizer) if chat_template else None
    return tokenizer.eos_token_id if eot is None else eot


def _added_special(tokenizer: Any) -> set[int]:
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {i for i, tok in decoder.items() if getattr(tok, "special", False)}


def chat_turn_ids(tokenizer: Any, text: str, role: str = "tool", *, closed: bool = True) -> list[int]:
    """The ids that follow an assistant turn when ``role`` says ``text`` (a tool's observation), up to
    and including the next generation prompt: what a multi-turn trajectory appends after a turn.

    ``closed``: the assistant turn already ends with the end-of-turn token (the engine stopped on it);
    when False (the turn ran out of tokens) the end-of-turn token is put first, so the conversation
    stays well formed. Rendered as the difference between a probe conversation with and without the
    new turn, cut right after the assistant's end-of-turn token, so any separator the template puts
    after it (ChatML's newline) belongs to this turn."""
    probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
    base = render(tokenizer, probe, generation_prompt=False)
    full = render(tokenizer, [*probe, {"role": role, "content": text}], generation_prompt=True)
    eot = end_of_turn_id(tokenizer)
    if eot is None or eot not in base:
        raise ValueError("the chat template closes an assistant turn with no special token, so a later turn "
                         "cannot be appended to generated tokens (fix: data.chat_template: false, or a tokenizer "
                         "whose template ends turns with one, e.g. <|im_end|>)")
    cut = len(base) - base[::-1].index(eot)
    if full[:cut] != base[:cut]:
        raise ValueError(f"the chat template renders the earlier turns differently once a {role!r} turn follows, "
                         "so the turn cannot be appended")
    return ([] if closed else [eot]) + full[cut:]
