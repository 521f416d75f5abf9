"""Issue 36 on real multi-turn trajectories: the agentic controller drives the real embedded engine
(TorchEngine, tiny random Qwen3, the chat demo tokenizer's ChatML template). The engine is subclassed
only to *record* the token ids each prefill row actually received (from its left-padded input tensor);
everything else is the real engine.

Checks: ``Turn.conditioning()`` of turn k is exactly what the engine prefilled for turn k (a multiset
over every request of the drive, and per request the engine's own input count); the loss mask derived
from the Parts' roles equals the mask the rollout wrote; ``Sample.from_parts`` rebuilds every sample.
"""

from __future__ import annotations

from collections import Counter

import pytest
from agentic_support import CountdownEnv
from unirl_agentic.controller import AgenticRolloutController

from unirl.api import (
    Qwen3Adapter,
    RunConfig,
    Sample,
    SamplingParams,
    build_chat_demo_tokenizer,
    default_runtime,
    end_of_turn_id,
)
from unirl.data.chat import chat_prompt_ids
from unirl.engine.torch_engine import TorchEngine


class RecordingEngine(TorchEngine):
    """The real TorchEngine; records each prefill row's token ids as the decoder received them."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.inputs: list[tuple[int, ...]] = []

    def _prefill(self, contexts, ids, pos, valid, max_new):
        width = ids.shape[1]
        for r in range(ids.shape[0]):
            self.inputs.append(tuple(ids[r][valid[r, :width]].tolist()))
        return super()._prefill(contexts, ids, pos, valid, max_new)


@pytest.fixture(scope="module")
def drive():
    tok = build_chat_demo_tokenizer()
    cfg = RunConfig()
    eng = RecordingEngine(config=cfg, adapter=Qwen3Adapter(), tokenizer=tok, runtime=default_runtime(cfg))
    questions = {f"p{i}": f"Q: {i}*7=? A:" for i in range(3)}

    def draw(k):
        return [Sample(id=pid, prompt_ids=chat_prompt_ids(tok, q, "You may call tools.")[0], prompt_text=q, answer=0)
                for pid, q in list(questions.items())[:k]]

    ctl = AgenticRolloutController(eng, CountdownEnv(lambda s: 3), tok, reward_fn=lambda text, s: 0.0,
                                   base_seed=5, chat_template=True)
    sampling = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=(tok.eos_token_id, end_of_turn_id(tok)))
    try:
        out = ctl.collect(draw, groups=3, n=2, sampling=sampling)
    finally:
        ctl.close()
        eng.close()
    return out, eng.inputs


def test_conditioning_of_each_turn_is_what_the_engine_prefilled(drive):
    out, inputs = drive
    assert len(out) == 6 and all(s.turns == 3 for s in out)
    wanted = Counter()
    for s in out:
        for t in s.turn_list():
            ids = tuple(tok for p in t.conditioning() for tok in p.tokens)
            wanted[ids] += 1
            assert len(ids) == s.requests[t.index].prompt_tokens, (s.id, t.index)
            assert ids == tuple(s.prompt_ids + s.response_ids[: t.start])
        # a later turn's conditioning holds the earlier turns' model Parts and the observations
        roles = [p.role for p in s.turn(2).conditioning()]
        assert roles == ["prompt", "model", "observation", "model", "observation"]
    assert sum(wanted.values()) == 18
    assert Counter(inputs) == wanted


def test_role_mask_and_round_trip_on_multi_turn_trajectories(drive):
    out, _ = drive
    for s in out:
        assert any(m == 0 for m in s.loss_mask) and any(m == 1 for m in s.loss_mask)
        assert s.role_mask() == s.loss_mask
        back = Sample.from_parts(s.id, s.parts)
        assert (back.prompt_ids, back.response_ids, back.loss_mask, back.rollout_logprobs, back.versions,
                back.spans) == (s.prompt_ids, s.response_ids, s.loss_mask, s.rollout_logprobs, s.versions, s.spans)
