"""The vLLM engine's request bookkeeping (:mod:`unirl_vllm.generation`) on its own: no vLLM is started.

What these pin: a sample whose response budget is spent gets no request; under ``ignore_eos`` the eos ids
leave ``stop_token_ids`` (vLLM would stop at them anyway); request ids are unique per call; the
load spreading puts the longest requests first on the least-loaded replica. Each oracle is computed here
by hand, not by the module.
"""

from __future__ import annotations

import itertools

from unirl.api import Sample, SamplingParams
from unirl_vllm.generation import assign, build_requests


def _sample(sid: str, response: int) -> Sample:
    s = Sample(id=sid, prompt_ids=[1, 2, 3])
    if response:
        s.append_model_turn(list(range(10, 10 + response)), [0.0] * response, 0, "length")
    return s


def test_spent_budget_gets_no_request_and_eos_leaves_the_stop_ids_under_ignore_eos():
    fresh, spent = _sample("p0@t/0", 0), _sample("p0@t/1", 4)
    sampling = SamplingParams(max_new_tokens=8, max_response_tokens=4, stop_token_ids=(7, 9), min_new_tokens=6)
    ids = itertools.count()
    eos_asked: list[bool] = []

    def eos() -> set[int]:
        eos_asked.append(True)
        return {9}

    requests, left = build_requests([fresh, spent], sampling, ignore_eos=True, eos_ids=eos, ids=ids)
    assert left == [spent]
    assert len(requests) == 1
    r = requests[0]
    assert r["_sample"] is fresh and r["prompt_ids"] == [1, 2, 3]
    assert r["max_tokens"] == 4 and r["min_tokens"] == 4  # the response budget (4) caps both
    assert r["stop_token_ids"] == (7,) and r["ignore_eos"] is True
    assert eos_asked == [True]

    again, _ = build_requests([fresh], sampling, ignore_eos=False, eos_ids=eos, ids=ids)
    assert again[0]["stop_token_ids"] == (7, 9) and eos_asked == [True]  # eos is asked only under ignore_eos
    assert again[0]["id"] != r["id"]  # a second call never reuses a request id


def test_assign_puts_the_longest_first_on_the_least_loaded_replica():
    # costs 10, 9, 4, 3 over 2 replicas: 10 -> r0, 9 -> r1, 4 -> r1 (9 < 10), 3 -> r0 (10 < 13)
    assert assign([4, 10, 3, 9], 2) == [1, 0, 0, 1]
    assert assign([5, 5, 5], 1) == [0, 0, 0]
