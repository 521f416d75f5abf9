"""``rollout.controller: openai_agent``: agents written against the real ``openai`` client, through the real
localhost endpoint, on the real embedded TorchEngine (tiny random Qwen3, byte-level demo tokenizer).

The oracles are independent of the server's own bookkeeping: what the engine sampled is read back from
each HTTP response (``unirl`` field) and compared with the trajectory's model Parts; the observations are
compared with the plain template spelled out by hand; the log-probs across a weight sync with a
teacher-forced forward of the engine's model under the new weights."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import openai
import pytest
import torch
from agentic_support import prompts
from unirl_agentic.engine_bridge import EngineBridge
from unirl_agentic.openai_controller import OpenAIAgentController
from unirl_agentic.openai_server import AgentServer

from unirl.api import Sample, SamplingParams

SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0, max_response_tokens=200)
MODEL = "unirl-policy"


def draw_tasks(tok, k_total: int = 1000):
    i = [0]

    def draw(k):
        out = [Sample(id=f"p{j}", prompt_ids=tok.encode(f"task {j}:", add_special_tokens=False),
                      prompt_text=f"task {j}:", answer=j) for j in range(i[0], i[0] + k)]
        i[0] += k
        return out
    return draw


def as_message(completion) -> dict:
    return completion.choices[0].message.model_dump(exclude_none=True)


async def three_turn_agent(client: openai.AsyncOpenAI, task: dict) -> dict:
    """Three model turns, a tool result and a user turn between them; returns what each response said it
    sampled (the oracle) in its metrics channel... kept on the side instead (a dict per task id)."""
    messages = [{"role": "user", "content": task["prompt"]}]
    seen = []
    for k in range(3):
        r = await client.chat.completions.create(model=MODEL, messages=messages)
        seen.append(r.model_extra["unirl"])
        messages.append(as_message(r))
        messages.append({"role": "tool", "tool_call_id": "c", "content": f"R{task['answer']}.{k}"} if k == 0
                        else {"role": "user", "content": f"again {k}"})
    SEEN[task["id"]] = seen
    return 1.0


SEEN: dict[str, list[dict]] = {}


def _expected_observation(prev_closed: bool, k: int, answer: int, eos: str) -> str:
    """The plain template's text for the message after turn k, spelled out by hand."""
    head = "" if prev_closed else eos
    return head + (f"\n<tool_response>R{answer}.{k}</tool_response>\n" if k == 0 else f"again {k}")


def test_ids_trained_on_are_the_ids_sampled_multi_turn(engine, tok):
    SEEN.clear()
    ctl = OpenAIAgentController(engine, tok, three_turn_agent, base_seed=1)
    try:
        out = ctl.collect(draw_tasks(tok), groups=3, n=2, sampling=SAMPLING)
    finally:
        ctl.close()
    assert len(out) == 6 and all(s.status in ("ok", "truncated") and s.reward == 1.0 for s in out)
    eos = tok.decode([tok.eos_token_id], skip_special_tokens=False)
    for s in out:
        model = [p for p in s.parts[1:] if p.trains]
        obs = [p for p in s.parts[1:] if not p.trains]
        seen = SEEN[s.id]
        assert len(model) == 3 and len(obs) == 2
        for part, served in zip(model, seen, strict=True):
            assert part.tokens == served["token_ids"]
            assert part.logprobs == pytest.approx(served["logprobs"], abs=0.0)
            assert set(served["versions"]) == {engine.weight_version}
        for k, part in enumerate(obs):
            closed = model[k].tokens[-1] == tok.eos_token_id
            assert tok.decode(part.tokens, skip_special_tokens=False) == _expected_observation(closed, k, s.answer, eos)
        assert s.prompt_ids == tok.encode(f"task {s.answer}:", add_special_tokens=False)
        assert s.meta["agent_prefix_breaks"] == 0 and s.meta["agent_requests"] == 3
    assert ctl.metrics()["agent/prefix_breaks"] == 0.0


def _perturb(engine, version: int) -> None:
    g = torch.Generator().manual_seed(version)
    state = engine.model.state_dict()
    engine.load_weights([(k, v + 0.05 * torch.randn(v.shape, generator=g)) for k, v in state.items()
                         if k != "lm_head.weight" or not engine.model.config.tie_word_embeddings], version)


def _teacher_forced(engine, context: list[int], ids: list[int]) -> list[float]:
    with torch.no_grad():
        x = torch.tensor([context + ids])
        logits = engine.model(x).logits[0, len(context) - 1:-1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


def test_ids_and_logprobs_survive_a_weight_sync_mid_session(engine, tok):
    bridge = EngineBridge(engine)
    server = AgentServer(bridge, tok)
    server.start()
    stop = threading.Event()
    pump = threading.Thread(target=bridge.pump, args=(stop.is_set,))
    pump.start()
    slot = prompts(tok, 1)[0].child(0)
    slot.seed = 5
    sess = server.open_session(slot, SAMPLING)
    client = openai.OpenAI(base_url=server.base_url, api_key=sess.key, max_retries=0)
    try:
        messages = [{"role": "user", "content": "hi"}]
        r1 = client.chat.completions.create(model=MODEL, messages=messages)
        v0 = engine.weight_version
        messages += [as_message(r1), {"role": "tool", "tool_call_id": "c", "content": "42"}]
        bridge.pause()
        late: dict = {}
        t = threading.Thread(target=lambda: late.update(r=client.chat.completions.create(model=MODEL, messages=messages)))
        t.start()
        time.sleep(0.5)
        assert "r" not in late and engine.in_flight == 0  # paused: the request waits, nothing runs
        _perturb(engine, v0 + 1)
        bridge.resume()
        t.join(60)
        r2 = late["r"]
    finally:
        stop.set()
        pump.join(30)
        server.close()
    s = sess.sample
    model = [p for p in s.parts[1:] if p.trains]
    assert [p.tokens for p in model] == [r1.model_extra["unirl"]["token_ids"], r2.model_extra["unirl"]["token_ids"]]
    assert [p.version for p in model] == [v0, v0 + 1]
    assert model[0].logprobs == r1.model_extra["unirl"]["logprobs"]
    assert model[1].logprobs == r2.model_extra["unirl"]["logprobs"]
    # the second turn was sampled by the new weights: a teacher-forced forward under them agrees
    ctx = s.prompt_ids + s.response_ids[:len(s.response_ids) - len(model[1].tokens)]
    assert model[1].logprobs == pytest.approx(_teacher_forced(engine, ctx, model[1].tokens), abs=1e-4)


async def editing_agent(client, task):
    messages = [{"role": "user", "content": task["prompt"]}]
    r = await client.chat.completions.create(model=MODEL, messages=messages)
    edited = [{"role": "user", "content": task["prompt"] + " (rephrased)"}, as_message(r),
              {"role": "user", "content": "go on"}]  # the history is rewritten: a branch
    await client.chat.completions.create(model=MODEL, messages=edited)
    return 0.5


def test_a_history_editing_agent_is_served_as_a_counted_branch(engine, tok):
    ctl = OpenAIAgentController(engine, tok, editing_agent, base_seed=2)
    try:
        out = ctl.collect(draw_tasks(tok), groups=2, n=2, sampling=SAMPLING)
    finally:
        ctl.close()
    assert ctl.metrics()["agent/prefix_breaks"] == 4.0
    for s in out:
        assert s.meta["agent_prefix_breaks"] == 1 and s.reward == 0.5
        assert s.turns == 1  # the trained branch: the edited conversation, rendered whole as its prompt
        assert tok.decode(s.prompt_ids, skip_special_tokens=False).startswith(f"task {s.answer}: (rephrased)")
        assert tok.decode(s.prompt_ids, skip_special_tokens=False).endswith("go on")


async def echo_agent(client, task):
    messages = [{"role": "user", "content": f"<{task['id']}>"}]
    for _k in range(2):
        r = await client.chat.completions.create(model=MODEL, messages=messages)
        SEEN.setdefault(task["id"], []).append(r.model_extra["unirl"])
        messages += [as_message(r), {"role": "tool", "tool_call_id": "c", "content": f"[{task['id']}]"}]
    return 1.0


def test_64_concurrent_sessions_never_mix(engine, tok):
    SEEN.clear()
    ctl = OpenAIAgentController(engine, tok, echo_agent, base_seed=3, concurrency=64)
    try:
        out = ctl.collect(draw_tasks(tok), groups=16, n=4, sampling=SAMPLING)
    finally:
        ctl.close()
    assert len(out) == 64 and not any(s.failed for s in out)
    for s in out:
        assert tok.decode(s.prompt_ids, skip_special_tokens=False) == f"<{s.id}>"
        obs = [p for p in s.parts[1:] if not p.trains]
        assert len(obs) == 1 and f"<tool_response>[{s.id}]</tool_response>" in tok.decode(obs[0].tokens)
        assert [p.tokens for p in s.parts[1:] if p.trains] == [x["token_ids"] for x in SEEN[s.id]]


async def flaky_agent(client, task):
    if task["answer"] % 3 == 1:
        raise RuntimeError("agent bug")
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": task["prompt"]}])
    if task["answer"] % 3 == 2:
        await asyncio.sleep(3600)  # hangs: the timeout ends it
    return {"reward": 1.0, "calls": 1}


def test_a_crashing_or_hanging_agent_fails_only_its_trajectory(engine, tok):
    ctl = OpenAIAgentController(engine, tok, flaky_agent, base_seed=4, timeout_s=2.0)
    try:
        out = ctl.collect(draw_tasks(tok), groups=3, n=2, sampling=SAMPLING)
    finally:
        ctl.close()
    by = {s.answer: s for s in out}
    ok, crashed, hung = (by[0], [s for s in out if s.answer == 1], [s for s in out if s.answer == 2])
    assert all(s.status != "failed" and s.reward == 1.0 for s in out if s.answer == 0) and ok.turns == 1
    assert all(s.status == "failed" and math.isnan(s.reward) and "agent bug" in s.meta["error"] for s in crashed)
    assert all(s.status == "failed" and math.isnan(s.reward) and "timeout" in s.meta["error"] for s in hung)
    m = ctl.metrics()
    assert m["agent/failed"] == 4.0 and m["agent/timeouts"] == 2.0 and m["agent/calls"] == 1.0
    assert engine.in_flight == 0


def test_agent_pools_use_the_sdk_aiohttp_transport_else_httpx(monkeypatch):
    import httpx
    import openai
    from unirl_agentic.openai_controller import agent_pool

    async def pools():
        fast = agent_pool(5.0, {"request": [], "response": []})
        monkeypatch.setattr(openai, "DefaultAioHttpClient", _NoAiohttp)
        plain = agent_pool(5.0, {"request": [], "response": []})
        out = (type(fast._transport).__name__, type(plain), plain.timeout.read)
        await fast.aclose()
        await plain.aclose()
        return out

    transport, plain, timeout = asyncio.run(pools())
    assert transport == "AiohttpTransport"
    assert plain is httpx.AsyncClient and timeout == 5.0


class _NoAiohttp:
    def __init__(self, **_kwargs):
        raise RuntimeError("To use the aiohttp client you must have installed the package with the `aiohttp` extra")
