"""The bring-your-own-agent demo: the agent in docs/agentic.md is the demo agent's file, it runs as written
through the real endpoint, its warm-start traces are the template's conversation token for token, and
(slow) the demo recipe learns: held-out accuracy +0.15 after the SFT warm start plus GRPO."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from unirl_agentic.agent_sessions import ChatRenderer, canonical
from unirl_agentic.examples import calc_agent
from unirl_agentic.openai_controller import OpenAIAgentController, render_trace, task_of

from unirl.api import Sample, SamplingParams, load_config, load_kernel

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "agentic-calc-openai-tiny.yaml"


def doc_agent() -> str:
    text = (ROOT / "docs" / "agentic.md").read_text()
    head = text.index("This is the complete demo agent")
    return re.search(r"```python\n(.*?)```", text[head:], re.DOTALL).group(1)


def test_the_documented_agent_is_the_demo_agent_as_written():
    assert doc_agent() == Path(calc_agent.__file__).read_text()


def arith(tok, k):
    return [Sample(id=f"p{a}", prompt_ids=[], prompt_text=f"Q: {a}*7=? A:", answer=a * 7) for a in range(k)]


def test_the_documented_agent_runs_through_the_endpoint(engine, tok):
    namespace: dict = {}
    exec(compile(doc_agent(), "docs/agentic.md", "exec"), namespace)  # noqa: S102 - the doc's own code, as written
    ctl = OpenAIAgentController(engine, tok, namespace["run"], base_seed=0, max_prompt_tokens=48)
    try:
        out = ctl.collect(lambda k: arith(tok, k), groups=2, n=2,
                          sampling=SamplingParams(max_new_tokens=8, max_response_tokens=64))
    finally:
        ctl.close()
    assert len(out) == 4 and not any(s.failed for s in out)  # a random model answers wrong, never crashes
    assert all(s.reward in (0.0, 1.0) and "used_tool" in s.meta["agent_metrics"] for s in out)
    for s in out:
        assert tok.decode(s.prompt_ids) == f"tools: calculator\n{s.prompt_text}"


def test_warm_start_traces_are_the_rendered_conversation(tok):
    renderer = ChatRenderer(tok)
    slot = arith(tok, 4)[3].child(0)
    messages, tools = calc_agent.demonstration(task_of(slot), True)
    s = render_trace(renderer, slot, canonical(messages), tools)
    eos = tok.decode([tok.eos_token_id], skip_special_tokens=False)
    dec = [tok.decode(p.tokens, skip_special_tokens=False) for p in s.parts]
    assert dec == ["tools: calculator\nQ: 3*7=? A:",
                   '<tool_call>{"name":"calculator","arguments":{"expression":"3*7"}}</tool_call>' + eos,
                   "\n<tool_response>21</tool_response>\n", " 21" + eos]
    assert [p.role for p in s.parts] == ["prompt", "tool_call", "observation", "model"]
    assert s.prompt_ids + s.response_ids == renderer.ids(canonical(messages), tools, gen=False)
    unaided = render_trace(renderer, slot.child(1), canonical(calc_agent.demonstration(task_of(slot), False)[0]), tools)
    assert [tok.decode(p.tokens, skip_special_tokens=False) for p in unaided.parts][1:] == [" 21" + eos]


def run_demo(out: Path, seed: int) -> tuple[list[dict], float]:
    from unirl.api import train

    config = load_config(RECIPE, [f"run.output_dir={out}", f"run.seed={seed}", "trainer.progress=false",
                                  "trainer.plot=false", "trainer.export_hf=false", "trainer.save_every=0"])
    t0 = time.perf_counter()
    result = train(config, load_kernel())
    return result.history, time.perf_counter() - t0


@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
@pytest.mark.slow
def test_the_openai_agent_demo_learns_to_use_the_calculator(tmp_path):
    history, seconds = run_demo(tmp_path, 0)
    evals = [h for h in history if "eval" in h]
    before, after = evals[0], evals[-1]
    report = (f"openai_agent demo ({seconds:.0f} s): held-out accuracy {before['eval']:.3f} -> {after['eval']:.3f}, "
              f"tool use {before.get('eval_agent/used_tool', float('nan')):.2f} -> "
              f"{after.get('eval_agent/used_tool', float('nan')):.2f}")
    print(report)
    assert after["eval"] - before["eval"] >= 0.15, report


def test_preflight_of_openai_agent_names_the_field_and_the_fix():
    from unirl.preflight import preflight

    k = load_kernel()
    ok = load_config(RECIPE, [])
    assert [v for v in preflight(ok, k) if v.source == "unirl-agentic"] == []
    cases = {"plugins.agentic.agent=null": "set plugins.agentic.agent",
             "plugins.agentic.agent=no_such_module:run": "importable module",
             "plugins.agentic.agent=unirl_agentic.examples.calc_agent:calculate": "async def run",
             "plugins.agentic.tool_parser=llama9": "qwen3"}
    for override, fix in cases.items():
        got = [v for v in preflight(load_config(RECIPE, [override]), k) if v.source == "unirl-agentic"]
        assert len(got) == 1 and fix in got[0].fix and got[0].field.startswith("plugins.agentic."), (override, got)


def test_a_tool_call_echoed_by_the_openai_client_extends_the_session():
    """The server's assistant message with a parsed call, round-tripped through the client's own model and
    ``model_dump(exclude_none=True)`` as an agent sends it back, is the same conversation (no branch)."""
    from openai.types.chat import ChatCompletionMessage
    from unirl_agentic.agent_sessions import Session
    from unirl_agentic.tool_parsers import parse_qwen3

    parsed = parse_qwen3('<tool_call>{"name": "calculator", "arguments": {"expression": "3*7"}}</tool_call>')
    assert parsed.content == "" and parsed.tool_calls[0]["function"]["name"] == "calculator"
    reply = {"role": "assistant", "content": None, "tool_calls": parsed.tool_calls}
    user = [{"role": "user", "content": "Q: 3*7=? A:"}]
    session = Session("k", Sample(id="p0@t/0", prompt_ids=[1]))
    session.start([1], canonical(user), calc_agent.TOOLS)
    session.served = canonical([*user, reply])
    echoed = ChatCompletionMessage.model_validate(reply).model_dump(exclude_none=True)
    follow = canonical([*user, echoed, {"role": "tool", "tool_call_id": "x", "content": "21"}])
    assert session.extends(follow, calc_agent.TOOLS)
    edited = canonical([{"role": "user", "content": "Q: 3*8=? A:"}, echoed, {"role": "tool", "content": "21"}])
    assert not session.extends(edited, calc_agent.TOOLS)
