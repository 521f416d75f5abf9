"""Tool-call parsing, the calculator's bounds, and ToolEnvironment's protocol (sessions, max_turns)."""

from __future__ import annotations

import pytest
from unirl_agentic.calculator import Calculator
from unirl_agentic.calls import CallError, ToolCall, parse_calls
from unirl_agentic.environment import ToolEnvironment, render_call
from unirl_agentic.options import AgenticOptions
from unirl_agentic.sandbox import PythonSandbox, SandboxOptions, processes_with_token
from unirl_agentic.tooling import ToolFailure

from unirl.api import Sample, Tool, ToolResult


def test_parse_calls_reads_qwen3_calls_and_reports_malformed_ones():
    text = ('think <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call> and '
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"4\\"}"}</tool_call>')
    assert parse_calls(text) == [ToolCall("calculator", {"expression": "2+3"}), ToolCall("calculator", {"expression": "4"})]
    for bad, why in [('<tool_call>{"name": "calculator", </tool_call>', "not valid JSON"),
                     ('<tool_call>[1, 2]</tool_call>', "JSON object"),
                     ('<tool_call>{"name": "c", "arguments": [1]}</tool_call>', "arguments must be"),
                     ('<tool_call>{"name": "c", "arguments": {}}', "unclosed")]:
        (err,) = parse_calls(bad)
        assert isinstance(err, CallError) and why in err.message, bad


def test_calculator_is_exact_and_bounded_without_eval():
    calc = Calculator()
    assert calc.call({"expression": "347*29"}) == ToolResult("10063")
    assert calc.call({"expression": "(2**64 - 1) // 3 % 1000"}).content == str((2**64 - 1) // 3 % 1000)
    assert calc.call({"expression": "7/2"}).content == "3.5"
    for expr, why in [("9**9**9", "exceeds"), ("10**60 * 10**60", "digits"), ("99**60", "digits"), ("2**65", "exponent"),
                      ("__import__('os').system('true')", "not allowed"), ("(1).real", "not allowed"),
                      ("1/0", "division by zero"), ("x+1", "not allowed"), ("1 +", "cannot parse"),
                      ("1e308*10", "not finite"), ("1" * 300, "longer")]:
        res = calc.call({"expression": expr})
        assert res.error and why in res.content, (expr, res)
    assert calc.call({"expr": "1"}).error


def _env(tools, **opts):
    return ToolEnvironment(tools=tools, options=AgenticOptions(**opts))


def _sample(i=0):
    return Sample(id=f"p{i}@t/0", prompt_ids=[1])


def test_a_turn_that_calls_a_tool_is_a_tool_call_part_and_the_answer_a_model_part():
    """Issue 36's roles: the engine appends every turn as ``model``; the tool environment, parsing it,
    re-roles a turn that called a tool as ``tool_call``. Both train (loss mask 1), observations do not;
    the old segment view still says "model" for both."""
    env = _env({"calculator": Calculator()}, max_turns=4)
    s = _sample()
    env.reset(s)
    call = render_call("calculator", {"expression": "12*34"})
    s.append_model_turn([5, 6, 7], [-0.1, -0.2, -0.3], 0, "stop", text=call)
    step = env.step(s, call)
    s.append_observation([8, 9], text=step.observation)
    s.append_model_turn([10], [-0.4], 0, "stop", text="408")
    assert env.step(s, "408").done
    env.close(s)
    assert [p.role for p in s.parts] == ["prompt", "tool_call", "observation", "model"]
    assert s.loss_mask == [1, 1, 1, 0, 0, 1] and s.role_mask() == s.loss_mask
    assert Sample.from_parts(s.id, s.parts).parts == s.parts
    with pytest.raises(Exception, match="role must be one of"):
        s.mark_last_turn("observation")


def test_demonstrations_mark_their_calls_as_tool_call_parts():
    from unirl_agentic.traces import tool_trace

    from unirl.api import build_demo_tokenizer

    prompt = Sample(id="p0@sft/0", prompt_ids=[1], prompt_text="Q: 12*34=? A:", answer=408)
    trace = tool_trace(prompt, build_demo_tokenizer())
    assert [p.role for p in trace.parts] == ["prompt", "tool_call", "observation", "model"]


def test_tool_env_runs_calls_renders_results_and_stops_on_an_answer():
    env = _env({"calculator": Calculator()}, max_turns=4)
    s = _sample()
    env.reset(s)
    step = env.step(s, "let me compute " + render_call("calculator", {"expression": "12*34"}))
    assert not step.done and step.observation == "\n<tool_response>408</tool_response>\n"
    step = env.step(s, '<tool_call>{"name": "calculator" oops</tool_call>')  # malformed: an observation
    assert not step.done and "error: tool call is not valid JSON" in step.observation
    step = env.step(s, render_call("nope", {}))
    assert "unknown tool 'nope'" in step.observation and s.meta["tool_errors"] == 2
    step = env.step(s, "The answer is 408.")
    assert step.done and step.info["final_answer"] == "The answer is 408." and step.reward is None
    env.close(s)
    assert env.live() == []


def test_tool_env_ends_at_max_turns_unanswered():
    env = _env({"calculator": Calculator()}, max_turns=2)
    s = _sample()
    env.reset(s)
    call = render_call("calculator", {"expression": "1+1"})
    assert not env.step(s, call).done
    last = env.step(s, call)
    assert last.done and last.info["max_turns"] and last.info["final_answer"] == ""
    env.close(s)


def test_qwen3_format_renders_a_tool_turn_of_the_chat_template():
    env = _env({"calculator": Calculator()}, format="qwen3")
    s = _sample()
    env.reset(s)
    obs = env.step(s, render_call("calculator", {"expression": "2*3"})).observation
    assert obs == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n"
                   "<|im_start|>assistant\n")
    env.close(s)


class Exploding(Tool):
    name = "boom"

    def call(self, arguments):
        raise RuntimeError("tool bug")


def test_tool_faults_are_failures_not_observations_and_sessions_always_end():
    sandbox = PythonSandbox(options=SandboxOptions(timeout_s=1.0))
    env = _env({"python_sandbox": sandbox, "boom": Exploding()})
    assert env.stateful
    a, b, c = _sample(0), _sample(1), _sample(2)
    for s in (a, b, c):
        env.reset(s)
    assert env.step(a, render_call("python_sandbox", {"code": "x = 2"})).observation.count("<tool_response>") == 1
    step = env.step(a, render_call("python_sandbox", {"code": "print(x * 21)"}))
    assert "42" in step.observation  # one persistent interpreter per trajectory
    step = env.step(b, render_call("python_sandbox", {"code": "print(x)"}))
    assert "NameError" in step.observation  # ... and not shared with another trajectory
    assert sorted(sandbox.live_sessions()) == [a.id, b.id]
    tokens = [sandbox._sessions[sid].token for sid in (a.id, b.id)]
    hung = env.step(a, render_call("python_sandbox", {"code": "while True: pass"}))
    assert hung.done and "wall clock" in hung.info["failure"]
    crash = env.step(c, render_call("boom", {}))
    assert crash.done and "tool bug" in crash.info["failure"]
    for s in (a, b, c):
        env.close(s)
    assert sandbox.live_sessions() == [] and env.live() == []
    assert all(processes_with_token(t) == [] for t in tokens)
    with pytest.raises(ToolFailure):
        sandbox.execute(a.id, {"code": "1"})
