"""Per-request timing of the embedded engine (issue 37): each row is stamped when it ends.

Why it matters: trace replays predict per-request latency and GRPO group completion; if every request
of a job carried the job's finish time, both collapsed to batch readiness in measurement. Response
lengths are skewed on purpose (each sample's remaining response budget differs, ``ignore_eos`` so the
budget is the length), so the finish stamps must differ within one batch and follow the token counts.
"""

from __future__ import annotations

import pytest

from unirl.config import RunConfig
from unirl.contracts import SamplingParams
from unirl.models.qwen3 import Qwen3Adapter
from unirl.models.tokenizer import build_demo_tokenizer
from unirl.samples import Sample, now_ms
from unirl.testing import build_engine

#: tokens already in each sample's response (an observation): the budget left is BUDGET - this
USED = (56, 40, 8, 0)
BUDGET = 64


def skewed_samples() -> list[Sample]:
    out = []
    for i, used in enumerate(USED):
        s = Sample(id=f"p{i}@t/0", prompt_ids=[2, 40 + i, 50 + i, 60 + i], seed=11 + i)
        if used:
            s.append_observation([70 + i] * used)
        out.append(s)
    return out


def skewed_sampling() -> SamplingParams:
    return SamplingParams(max_new_tokens=BUDGET, max_response_tokens=BUDGET, temperature=1.0, ignore_eos=True,
                          stop_token_ids=())


def assert_per_request_times(samples: list[Sample], job_end_ms: float) -> None:
    """Finish stamps differ, are ordered like the token counts, and none is the job's end."""
    recs = [s.requests[-1] for s in samples]
    lengths = [r.new_tokens for r in recs]
    assert lengths == [BUDGET - u for u in USED], lengths  # the skew really happened
    ends = [r.finished_ms for r in recs]
    assert all(r.submitted_ms <= r.first_token_ms <= r.finished_ms <= job_end_ms for r in recs), recs
    assert len(set(ends)) == len(ends), f"finish stamps repeat within one batch: {ends}"
    order_by_tokens = sorted(range(len(recs)), key=lambda i: lengths[i])
    assert [ends[i] for i in order_by_tokens] == sorted(ends), (lengths, ends)
    # the longest row ends last; every shorter one ended strictly earlier (not at the job's end)
    assert max(ends) - min(ends) > 0.0


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "hf"])
def test_embedded_engine_stamps_each_row_when_it_ends(fast_path):
    tok = build_demo_tokenizer()
    engine = build_engine(RunConfig(rollout={"options": {"fast_path": fast_path}}), adapter=Qwen3Adapter(),
                          tokenizer=tok)
    try:
        samples = engine.generate(skewed_samples(), skewed_sampling())
        assert_per_request_times(samples, now_ms())
    finally:
        engine.close()
