"""Issue 36: a Sample's content as Parts with roles, grouped into Turns; fork ids; the deprecated
segment accessors.

Oracles: the flat per-token lists as ``append_model_turn`` / ``append_observation`` wrote them (Parts are
a view of them and must rebuild them exactly), the loss mask written at rollout time (the role-derived
mask must equal it), and on the real embedded engine the samples it generated.
"""

from __future__ import annotations

import warnings

import pytest

import unirl.samples as samples_mod
from unirl.kernel.errors import SampleError
from unirl.samples import (
    NO_VERSION,
    OBSERVATION_LOGPROB,
    Part,
    Sample,
    Segment,
    Span,
    fork_id,
    fork_point,
)


def trajectory(sid: str = "p1@t/0") -> Sample:
    """prompt [1,2,3]; turn 0: model [10,11] (v3) + observation [20,21,22]; turn 1: model [12] (v4)."""
    s = Sample(id=sid, prompt_ids=[1, 2, 3])
    s.append_model_turn([10, 11], [-0.5, -0.25], 3, "stop", text="ab")
    s.append_observation([20, 21, 22], text="obs")
    s.append_model_turn([12], [-1.0], 4, "stop", text="c")
    return s


def test_parts_are_the_prompt_then_each_span_with_role_logprobs_and_version():
    parts = trajectory().parts
    assert parts == [
        Part("prompt", [1, 2, 3]),
        Part("model", [10, 11], [-0.5, -0.25], 3, turn=0),
        Part("observation", [20, 21, 22], None, NO_VERSION, turn=0),
        Part("model", [12], [-1.0], 4, turn=1),
    ]
    assert [p.trains for p in parts] == [False, True, False, True]


def test_from_parts_round_trips_the_flat_lists_and_spans():
    s = trajectory()
    back = Sample.from_parts(s.id, s.parts)
    for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "versions", "spans"):
        assert getattr(back, name) == getattr(s, name), name
    assert back.rollout_logprobs[2:5] == [OBSERVATION_LOGPROB] * 3 and back.versions[2:5] == [NO_VERSION] * 3


def test_any_role_and_an_opaque_payload_survive_the_round_trip():
    s = Sample(id="p1@t/0", prompt_ids=[1])
    s.append_part(Part("tool_call", [7, 8], [-0.1, -0.2], 2, turn=0))
    s.append_part(Part("image", [], payload={"ref": "img-0"}, turn=0))
    s.append_part(Part("observation", [9], turn=0))
    assert s.loss_mask == [1, 1, 0] and s.role_mask() == s.loss_mask
    assert s.parts[2] == Part("image", [], None, NO_VERSION, 0, {"ref": "img-0"})
    assert s.turns == 1
    assert Sample.from_parts(s.id, s.parts).spans == s.spans
    with pytest.raises(SampleError, match="'tool_call' Part of 2 tokens has none log-probs"):
        s.append_part(Part("tool_call", [1, 2]))
    with pytest.raises(SampleError, match="first Part must have role 'prompt'"):
        Sample.from_parts("x", [Part("model", [1], [-1.0])])


def test_role_mask_equals_the_rollout_mask_and_parts_fall_back_to_mask_runs():
    s = trajectory()
    assert s.role_mask() == s.loss_mask == [1, 1, 0, 0, 0, 1]
    # a sample built without spans (a warm start writes response_ids and loss_mask only)
    bare = Sample(id="p1@t/1", prompt_ids=[1], response_ids=[5, 6, 7, 8], loss_mask=[1, 1, 0, 1],
                  rollout_logprobs=[-1.0, -1.0, 0.0, -2.0], versions=[0, 0, -1, 0])
    assert [(p.role, p.tokens, p.turn) for p in bare.parts[1:]] == [("model", [5, 6], 0), ("observation", [7], 0),
                                                                    ("model", [8], 1)]
    assert bare.role_mask() == bare.loss_mask
    # a warm-start sample: ids and mask only, no log-probs or versions
    warm = Sample(id="p1@t/2", prompt_ids=[1], response_ids=[5, 6], loss_mask=[1, 1])
    assert warm.parts[1] == Part("model", [5, 6], [], NO_VERSION, 0) and len(warm.turn_list()) == 1


def test_turns_group_a_call_with_its_response_and_conditioning_is_everything_before_it():
    s = trajectory()
    t0, t1 = s.turn_list()
    assert [p.role for p in t0.parts] == ["model", "observation"] and (t0.start, t0.end) == (0, 5)
    assert [p.role for p in t1.parts] == ["model"] and (t1.start, t1.end) == (5, 6)
    assert [tok for p in t0.conditioning() for tok in p.tokens] == [1, 2, 3]
    assert [tok for p in t1.conditioning() for tok in p.tokens] == [1, 2, 3, 10, 11, 20, 21, 22]
    assert s.turn(1) == t1 and [p.tokens for p in t1.model_parts] == [[12]]
    with pytest.raises(SampleError, match="has no turn 2"):
        s.turn(2)
    # environment content before the first call conditions turn 0 and belongs to no turn
    lead = Sample(id="p1@t/2", prompt_ids=[1])
    lead.append_observation([4, 4])
    lead.append_model_turn([5], [-1.0], 0, "stop")
    (only,) = lead.turn_list()
    assert only.start == 2 and [p.role for p in only.conditioning()] == ["prompt", "observation"]


def test_segments_still_work_and_warn_once(monkeypatch):
    monkeypatch.setattr(samples_mod, "_SEGMENTS_WARNED", False)
    s = trajectory()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert s.segments == [Segment("model", 0, 0, 2), Segment("observation", 0, 2, 5),
                              Segment("model", 1, 5, 6)]
        assert s.segments[-1] is s.segments[-1]  # old code compares segments by identity
        s.segments = s.segments[:2]
        assert s.segments == [Segment("model", 0, 0, 2), Segment("observation", 0, 2, 5)]
    dep = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(dep) == 1 and "Sample.parts" in str(dep[0].message)
    assert s.spans == [Span("model", 0, 0, 2), Span("observation", 0, 2, 5)]


def test_fork_ids_extend_the_parent_path_and_name_the_fork_group():
    child = fork_id("p17@train-3/0", 2, 1)
    assert child == "p17@train-3/0/f2.1" and fork_point(child) == ("p17@train-3/0", 2, 1)
    s = Sample(id=child, prompt_ids=[1])
    assert (s.group_id, s.prompt_id, s.parent_id) == ("p17@train-3", "p17", "p17@train-3/0")
    assert s.fork_group_id == "p17@train-3/0/f2"
    nested = Sample(id=fork_id(child, 4, 0), prompt_ids=[1])
    assert nested.fork_group_id == "p17@train-3/0/f2.1/f4" and nested.group_id == "p17@train-3"
    # not a fork branch: a branch of its launch
    assert Sample(id="p17@train-3/5", prompt_ids=[1]).fork_group_id == "p17@train-3"
    assert fork_point("p17@train-3/5") is None
    with pytest.raises(SampleError, match="must be >= 0"):
        fork_id("p1@t/0", -1, 0)


def test_the_real_embedded_engine_writes_parts_whose_roles_give_its_mask():
    from unirl.api import default_runtime
    from unirl.config import RunConfig
    from unirl.contracts import SamplingParams
    from unirl.engine.torch_engine import TorchEngine
    from unirl.models.qwen3 import Qwen3Adapter
    from unirl.models.tokenizer import build_demo_tokenizer
    from unirl.samples import expand

    tok = build_demo_tokenizer()
    cfg = RunConfig()
    eng = TorchEngine(config=cfg, adapter=Qwen3Adapter(), tokenizer=tok, runtime=default_runtime(cfg))
    try:
        prompts = [Sample(id=f"q{i}", prompt_ids=tok.encode(f"{i}+{i}=", add_special_tokens=False)) for i in range(3)]
        out = eng.generate(expand(prompts, 2, tag="t", base_seed=1), SamplingParams(max_new_tokens=6))
        # a second turn continues the trajectory (observation, then model)
        for s in out:
            s.append_observation(tok.encode("ok", add_special_tokens=False))
        out = eng.generate(out, SamplingParams(max_new_tokens=4))
    finally:
        eng.close()
    assert all(s.turns == 2 and s.response_ids for s in out)
    for s in out:
        assert s.role_mask() == s.loss_mask
        back = Sample.from_parts(s.id, s.parts)
        assert (back.response_ids, back.loss_mask, back.rollout_logprobs, back.versions, back.spans) == \
            (s.response_ids, s.loss_mask, s.rollout_logprobs, s.versions, s.spans)
        # conditioning of turn 1 is what the engine recorded as its input length
        assert sum(len(p.tokens) for p in s.turn(1).conditioning()) == s.requests[1].prompt_tokens


def test_the_new_types_are_public():
    import unirl.api as api

    for name in ("Part", "Turn", "Span", "MODEL_ROLES", "fork_id", "fork_point"):
        assert getattr(api, name) is getattr(samples_mod, name), name
    assert "group_layers" in api.__all__
