"""Warm-start traces: what a trajectory of the demo task looks like when it is done right.

Built exactly as a rollout builds a trajectory (model turns loss mask 1, tool turns 0), so SFT on them
teaches the format the controller then samples (``plugins.agentic.warm_start``)."""

from __future__ import annotations

from typing import Any

from unirl.api import Sample, chat_turn_ids, response_end_id
from unirl_agentic.calculator import Calculator
from unirl_agentic.environment import FORMATS, render_call


def expression_of(prompt_text: str) -> str:
    """``"Q: 347*29=? A:"`` -> ``"347*29"`` (the arith task's prompt format)."""
    return prompt_text.removeprefix("Q: ").split("=", 1)[0].strip()


def tool_trace(prompt: Sample, tokenizer: Any, template: str = FORMATS["plain"], *, chat: bool = False) -> Sample:
    """One SFT trace: call the calculator on the prompt's expression, then answer with its result.

    Segments and masks are built exactly as a rollout builds them (model turns mask 1, the tool turn 0);
    with ``chat`` (``data.chat_template``) each model turn ends with the template's end-of-turn token and
    the tool turn is rendered by the template."""
    expr = expression_of(prompt.prompt_text)
    result = Calculator().call({"expression": expr}).content
    s = prompt.child(0)
    call = " " + render_call("calculator", {"expression": expr})
    eos = response_end_id(tokenizer, chat)
    ids = tokenizer.encode(call, add_special_tokens=False) + ([eos] if chat else [])
    s.append_model_turn(ids, [-1.0] * len(ids), 0, "stop", text=call, role="tool_call")  # log-probs unused by SFT
    obs = template.format(content=result)
    obs_ids = chat_turn_ids(tokenizer, obs) if chat else tokenizer.encode(obs, add_special_tokens=False)
    s.append_observation(obs_ids, text=obs)
    answer = tokenizer.encode(result, add_special_tokens=False) + [eos]
    s.append_model_turn(answer, [-1.0] * len(answer), 0, "stop", text=result)
    return s


def answer_trace(prompt: Sample, tokenizer: Any, *, chat: bool = False) -> Sample:
    """One SFT trace without tools: the answer as one model turn (what core's plain SFT trains)."""
    s = prompt.child(0)
    text = f" {prompt.answer}"
    ids = tokenizer.encode(text, add_special_tokens=False) + [response_end_id(tokenizer, chat)]
    s.append_model_turn(ids, [-1.0] * len(ids), 0, "stop", text=text)
    return s
