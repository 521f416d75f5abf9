"""Issue 36 item 2: ``Sample.fork`` and prefix sharing on the embedded engine.

Oracles: the tokens the real :class:`TorchEngine`'s decoder actually prefilled (its ``prefill`` wrapped
to count the non-pad context tokens it was given: an independent count of the computation, not the
engine's own claim), and each branch generated again on its own (a copy with the same id, seed and
prefix, submitted alone, so nothing can be shared): its tokens and log-probs must be the shared run's.
"""

from __future__ import annotations

import pytest

from unirl.kernel.errors import SampleError
from unirl.samples import Sample, fork_point, stable_seed


def _engine(batch_size: int = 64):
    from unirl.api import count_prefill, default_runtime
    from unirl.config import RunConfig
    from unirl.engine.torch_engine import TorchEngine
    from unirl.models.qwen3 import Qwen3Adapter
    from unirl.models.tokenizer import build_demo_tokenizer

    tok = build_demo_tokenizer()
    cfg = RunConfig()
    eng = TorchEngine(config=cfg, adapter=Qwen3Adapter(), tokenizer=tok, runtime=default_runtime(cfg))
    eng.options = eng.options.model_copy(update={"batch_size": batch_size})  # rows per forward (chunking)
    assert eng.decoder.shares_prefill  # the default fast decoder; the test is about its shared prefill
    return eng, tok, count_prefill(eng)


def _parent(tok, eng, sid: str = "p1@t/0", seed: int = 11) -> Sample:
    """A trajectory one model turn and one observation in: the fork point is before its turn 1."""
    from unirl.contracts import SamplingParams

    s = Sample(id=sid, prompt_ids=tok.encode("3*4=", add_special_tokens=False), seed=seed)
    eng.generate([s], SamplingParams(max_new_tokens=5))
    s.append_observation(tok.encode("<r>12</r>", add_special_tokens=False), text="<r>12</r>")
    return s


def test_fork_shares_the_prefix_parts_and_extends_the_path():
    s = Sample(id="p1@t/0", prompt_ids=[1, 2], seed=5)
    s.append_model_turn([7, 8], [-0.1, -0.2], 3, "stop", text="ab")
    s.append_observation([9], text="o")
    b = s.fork(1)
    assert b.id == "p1@t/0/f1.1" and fork_point(b.id) == ("p1@t/0", 1, 1) and b.fork_group_id == "p1@t/0/f1"
    assert b.parts == s.parts and b.context_ids == s.context_ids and b.response_text == s.response_text
    assert b.seed == stable_seed(5, "f1.1") != s.fork(0).seed
    b.append_model_turn([4], [-0.3], 4, "stop")  # a branch grows on its own
    assert len(s.response_ids) == 3 and b.turns == 2
    s.mark_failed("boom")
    with pytest.raises(SampleError, match="cannot be forked"):
        s.fork(0)


def test_branches_prefill_the_shared_prefix_once_and_match_independent_generations():
    from unirl.contracts import SamplingParams

    eng, tok, prefilled = _engine()
    try:
        parent = _parent(tok, eng)
        L = len(parent.context_ids)
        n = 4
        branches = [parent.fork(b) for b in range(n)]
        alone = [b.copy() for b in branches]  # same ids, seeds and prefix: the unshared oracle
        sp = SamplingParams(max_new_tokens=8)
        prefilled.clear()
        eng.generate(branches, sp)
        shared_tokens = sum(prefilled)
        prefilled.clear()
        for a in alone:
            eng.generate([a], sp)
        alone_tokens = sum(prefilled)
    finally:
        eng.close()
    print(f"\nfork prefix {L} tokens x {n} branches: prefilled {shared_tokens} shared, {alone_tokens} alone")
    assert shared_tokens == L  # the shared prefix went through the model once
    assert alone_tokens == n * L
    # the engine's own account (a production field traces export) agrees with the count
    assert sorted(b.requests[-1].cached_tokens for b in branches) == [0] + [L] * (n - 1)
    assert sum(b.requests[-1].prompt_tokens - b.requests[-1].cached_tokens for b in branches) == shared_tokens
    assert all(a.requests[-1].cached_tokens == 0 for a in alone)
    assert len({tuple(b.response_ids) for b in branches}) > 1  # the branches really branched
    worst = 0.0
    for b, a in zip(branches, alone, strict=True):
        assert b.response_ids == a.response_ids and b.loss_mask == a.loss_mask
        assert b.response_ids[: len(parent.response_ids)] == parent.response_ids
        worst = max(worst, *(abs(x - y) for x, y in zip(b.rollout_logprobs, a.rollout_logprobs, strict=True)))
    print(f"max |dlogp| shared vs alone: {worst:.3g}")
    assert worst <= 1e-6


def test_branches_submitted_among_other_rows_still_land_in_one_chunk():
    """Branches interleaved with other rows of the same context length, the batch cut in chunks of 4:
    the engine orders equal contexts together, so the fork's prefix is still prefilled once."""
    from unirl.contracts import SamplingParams

    eng, tok, prefilled = _engine(batch_size=4)
    try:
        parent = _parent(tok, eng)
        other = _parent(tok, eng, sid="p2@t/0", seed=99)
        assert len(other.context_ids) == len(parent.context_ids) and other.context_ids != parent.context_ids
        b = [parent.fork(i) for i in range(4)]
        o = [other.fork(i) for i in range(2)]
        prefilled.clear()
        eng.generate([b[0], o[0], b[1], o[1], b[2], b[3]], SamplingParams(max_new_tokens=3))
    finally:
        eng.close()
    L = len(parent.context_ids)
    assert sum(prefilled) == 2 * L  # one prefill per distinct context, not one per chunk it was cut into
    assert [x.requests[-1].cached_tokens for x in b].count(0) == 1
