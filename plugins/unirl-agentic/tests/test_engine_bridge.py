"""The endpoint's engine bridge on the real embedded TorchEngine: the turns that reach it in one pass of the
agents' loop become one engine job, and that job's results go back to the loop in one hand-off (not one
wake-up per request), each request getting its own sample."""

from __future__ import annotations

import asyncio
import threading

import unirl_agentic.engine_bridge as bridge_mod
from unirl_agentic.engine_bridge import EngineBridge

from unirl.api import Sample, SamplingParams


def test_one_job_and_one_hand_off_per_turn_of_the_agents(engine, tok, monkeypatch):
    handoffs: list[int] = []
    real_settle = bridge_mod._settle_all
    monkeypatch.setattr(bridge_mod, "_settle_all", lambda items: (handoffs.append(len(items)), real_settle(items)))
    jobs: list[int] = []
    real_submit = engine.submit

    def submit(samples, sampling):
        jobs.append(len(samples))
        return real_submit(samples, sampling)

    monkeypatch.setattr(engine, "submit", submit)
    bridge = EngineBridge(engine)
    k, sampling = 8, SamplingParams(max_new_tokens=4, temperature=1.0, max_response_tokens=64)
    samples = [Sample(id=f"b{i}", prompt_ids=tok.encode(f"row {i}:", add_special_tokens=False), seed=i)
               for i in range(k)]
    loop = asyncio.new_event_loop()
    bridge.expect(k, k)
    bridge.loop = loop

    async def turns():
        return await asyncio.gather(*(bridge.generate(s, sampling) for s in samples))

    out: list = []
    agents = threading.Thread(target=lambda: out.extend(loop.run_until_complete(turns())))
    agents.start()
    try:
        bridge.pump(until=lambda: not agents.is_alive())
    finally:
        agents.join(30)
        loop.close()
    assert [s.id for s in out] == [s.id for s in samples]  # each request got its own row back
    assert all(len(s.response_ids) == 4 and len(s.rollout_logprobs) == 4 for s in out)
    assert jobs == [k]  # the 8 turns sent in one pass of the loop ran as one engine job
    assert handoffs == [k]  # ... and came back to the loop in one call_soon_threadsafe
    assert bridge.turns == k
