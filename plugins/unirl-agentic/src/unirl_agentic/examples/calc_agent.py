"""A calculator agent written only against the OpenAI API (docs/agentic.md, "Bring your own agent").

It declares the calculator as an OpenAI function tool, runs the tool in its own code, and scores its
final answer. Point any OpenAI-compatible endpoint at it; under ``rollout.controller: openai_agent``
UniRL hands it a client whose every completion becomes training data.
"""

import ast
import json
import operator

import openai

MODEL = "unirl-policy"  # what GET /v1/models lists
TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression with + - * and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """The tool, in the agent's own code: integer arithmetic on a whitelisted syntax tree (no eval)."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 10**12:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only integers with + - * are supported")

    try:
        return str(value(ast.parse(expression[:200], mode="eval").body))
    except (ValueError, SyntaxError) as exc:
        return f"error: {exc}"


async def run(client: openai.AsyncOpenAI, task: dict) -> dict:
    """Ask, run every tool call the model makes (at most 3 model turns), grade the final answer."""
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(3):
        reply = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # sent back as returned: token identity
        if not message.tool_calls:
            answer = (message.content or "").strip()
            return {"reward": float(answer == str(task["answer"])), "used_tool": float(len(messages) > 2)}
        for call in message.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = calculate(str(args["expression"])) if isinstance(args, dict) and "expression" in args \
                    else "error: pass {\"expression\": ...}"
            except ValueError:
                result = "error: the arguments are not JSON"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {"reward": 0.0, "used_tool": 1.0}  # still calling tools after 3 turns


def demonstration(task: dict, expert: bool) -> tuple[list, list]:
    """An SFT warm-start conversation (plugins.agentic.warm_start: agent): call the tool and copy its
    result (expert), or answer at once."""
    question = task["prompt"]
    if not expert:
        return [{"role": "user", "content": question},
                {"role": "assistant", "content": f" {task['answer']}"}], TOOLS
    expression = question.removeprefix("Q: ").split("=", 1)[0].strip()
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": calculate(expression)},
            {"role": "assistant", "content": f" {task['answer']}"}], TOOLS
