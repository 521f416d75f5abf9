"""AgenticRolloutController on the real embedded TorchEngine (tiny random Qwen3): assembly, groups,
partial rollout (carry / drop), namespacing, failures, caps."""

from __future__ import annotations

import math

import pytest
import torch
from agentic_support import CountdownEnv, drawer, index, prompts
from unirl_agentic.controller import AgenticRolloutController
from unirl_agentic.groups import PendingGroups
from unirl_agentic.options import AgenticOptions

from unirl.algorithms.advantages import grpo
from unirl.api import SamplingParams
from unirl.config import AlgorithmSection
from unirl.samples import OBSERVATION_LOGPROB, Sample

SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0)


def prompt_index(s: Sample) -> int:
    return int(s.prompt_id[1:])


def make(engine, tok, env, **opts) -> AgenticRolloutController:
    return AgenticRolloutController(engine, env, tok, reward_fn=lambda text, s: 0.0,
                                    options=AgenticOptions(**opts), base_seed=7)


def test_masks_token_ids_and_logprobs_are_exactly_what_the_engine_generated(engine, tok):
    env = CountdownEnv(lambda s: 3)
    ctl = make(engine, tok, env)
    out = ctl.collect(drawer(tok), groups=2, n=2, sampling=SAMPLING)
    ctl.close()
    assert len(out) == 4
    model = engine.model
    for s in out:
        kinds = [seg.kind for seg in s.segments]
        assert kinds == ["model", "observation", "model", "observation", "model"]
        for seg in s.segments:
            span = range(seg.start, seg.end)
            if seg.kind == "observation":  # the tool turn: its own tokens, never trained, no policy
                text = f"\n<tool_response>obs{seg.turn + 1}</tool_response>\n"
                assert s.response_ids[seg.start:seg.end] == tok.encode(text, add_special_tokens=False)
                assert all(s.loss_mask[i] == 0 and s.versions[i] == -1 for i in span)
                assert all(s.rollout_logprobs[i] == OBSERVATION_LOGPROB for i in span)
            else:
                assert all(s.loss_mask[i] == 1 and s.versions[i] == 0 for i in span)
                # independent oracle: the same request regenerated alone gives the same token ids
                again = s.copy()
                again.id = s.id + "-again"
                for f in ("response_ids", "loss_mask", "rollout_logprobs", "versions"):
                    setattr(again, f, getattr(s, f)[:seg.start])
                again.segments = [g for g in s.segments if g.end <= seg.start]
                again.requests, again.response_text = [], ""
                engine.generate([again], SAMPLING)
                assert again.response_ids[seg.start:] == s.response_ids[seg.start:seg.end]
        # teacher-forced replay of prompt + response reproduces the rollout log-probs on model tokens
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, :-1], -1)
        P = len(s.prompt_ids)
        ref = logp[P - 1:].gather(-1, ids[0, P:, None])[:, 0]
        got = torch.tensor(s.rollout_logprobs)
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(got[mask], ref[mask], atol=1e-4, rtol=0)
        assert s.meta["version"] == 0 and s.meta["min_version"] == 0
        assert len(s.requests) == s.turns == 3


def test_pending_groups_release_a_group_only_when_every_sibling_is_terminal():
    pg = PendingGroups()
    pg.open("p0@t", 3)
    sibs = [Sample(id=f"p0@t/{i}", prompt_ids=[1]) for i in range(3)]
    assert pg.add(sibs[2]) is None and pg.add(sibs[0]) is None
    assert [s.id for s in pg.add(sibs[1])] == ["p0@t/0", "p0@t/1", "p0@t/2"]
    assert len(pg) == 0
    with pytest.raises(ValueError, match="not pending"):
        pg.add(Sample(id="p9@t/0", prompt_ids=[1]))


def test_ragged_siblings_come_back_as_whole_groups(engine, tok):
    env = CountdownEnv(lambda s: 1 + index(s) % 3)  # siblings finish after 1, 2 and 3 turns
    ctl = make(engine, tok, env)
    out = ctl.collect(drawer(tok), groups=2, n=3, sampling=SAMPLING)
    ctl.close()
    groups = [out[i:i + 3] for i in range(0, 6, 3)]
    for g in groups:
        assert len({s.group_id for s in g}) == 1
        assert [index(s) for s in g] == [0, 1, 2]
        assert [s.turns for s in g] == [1, 2, 3]
        assert all(s.status != "pending" and not s.failed for s in g)
    assert env.live() == [] and all(v == 1 for v in env.closes.values())


def test_refills_never_merge_two_launches_of_one_prompt(engine, tok):
    env = CountdownEnv(lambda s: 1)
    ctl = make(engine, tok, env, over_generate=1.0)
    same = lambda k: prompts(tok, 1)  # noqa: E731 - the source hands out p0 every time
    out = ctl.collect(same, groups=3, n=2, sampling=SAMPLING)
    out2 = ctl.collect(same, groups=1, n=2, sampling=SAMPLING)
    ctl.close()
    gids = [s.group_id for s in out]
    assert len(set(gids)) == 3 and all(gids.count(g) == 2 for g in gids)
    assert {s.prompt_id for s in out} == {"p0"}
    assert not set(gids) & {s.group_id for s in out2}  # a second drive gets fresh tags too


def _sync(engine, version: int) -> None:
    state = engine.model.state_dict()
    engine.load_weights([(k, v.clone()) for k, v in state.items() if k != "lm_head.weight"
                         or not engine.model.config.tie_word_embeddings], version)


@pytest.mark.parametrize("interrupt", ["drain", "abort"])
def test_partial_rollout_carries_the_tail_across_a_weight_sync(engine, tok, interrupt):
    env = CountdownEnv(lambda s: 1 if prompt_index(s) == 0 else 4)
    ctl = make(engine, tok, env, over_generate=3.0, tail="carry", interrupt=interrupt)
    first = ctl.collect(drawer(tok), groups=1, n=2, sampling=SAMPLING)
    assert {s.prompt_id for s in first} == {"p0"}  # the fastest group is committed
    assert ctl.last.carried == 4 and len(env.live()) == 4  # p1, p2 wait at a turn boundary
    assert engine.in_flight == 0  # nothing of ours in flight: the sync is allowed
    _sync(engine, engine.weight_version + 1)
    v = engine.weight_version
    second = ctl.collect(drawer(tok, start=100), groups=2, n=2, sampling=SAMPLING)
    ctl.close()
    assert {s.prompt_id for s in second} == {"p1", "p2"}  # carried groups complete first
    assert all(s.group_id.endswith("@agentic1.0") for s in second)
    for s in second:
        model_versions = {x for x, m in zip(s.versions, s.loss_mask, strict=True) if m}
        assert model_versions == {v - 1, v}  # tokens before the sync and after it, each stamped
        assert s.meta["version"] == v and s.meta["min_version"] == v - 1
        assert s.turns == 4 and len(s.requests) == 4
        s.validate()
    assert env.live() == [] and all(c == 1 for c in env.closes.values())
    assert set(env.closes) == set(env.opened)


def test_drop_policy_closes_the_tail_and_forgets_its_groups(engine, tok):
    env = CountdownEnv(lambda s: 1 if prompt_index(s) == 0 else 4)
    ctl = make(engine, tok, env, over_generate=3.0, tail="drop")
    first = ctl.collect(drawer(tok), groups=1, n=2, sampling=SAMPLING)
    assert {s.prompt_id for s in first} == {"p0"}
    assert ctl.last.dropped == 4 and env.live() == [] and engine.in_flight == 0
    assert set(env.closes) == set(env.opened) and all(c == 1 for c in env.closes.values())
    second = ctl.collect(drawer(tok, start=100), groups=1, n=2, sampling=SAMPLING)
    ctl.close()
    assert all(s.group_id.endswith("@agentic2.0") for s in second)


def test_failed_sibling_gets_nan_and_leaves_the_others_advantages_unchanged(engine, tok):
    env = CountdownEnv(lambda s: 2, fail_ids={"p0@agentic1.0/2"})
    ctl = make(engine, tok, env)
    out = ctl.collect(drawer(tok), groups=1, n=4, sampling=SAMPLING)
    ctl.close()
    bad = next(s for s in out if index(s) == 2)
    assert bad.failed and math.isnan(bad.reward) and "injected tool timeout" in bad.meta["error"]
    good = [s for s in out if s is not bad]
    assert [s.reward for s in good] == [0.0, 1.0, 1.0]
    alg = AlgorithmSection()
    with_failed = grpo(out, options={}, algorithm=alg).advantages
    without = grpo(good, options={}, algorithm=alg).advantages
    for s, a in zip(out, with_failed, strict=True):
        if s is bad:
            assert torch.all(a == 0)
    others = [a for s, a in zip(out, with_failed, strict=True) if s is not bad]
    for a, b in zip(others, without, strict=True):
        torch.testing.assert_close(a, b)


def test_close_runs_on_every_exit_path(engine, tok):
    env = CountdownEnv(lambda s: 2, crash_ids={"p0@agentic1.0/1"})
    ctl = make(engine, tok, env)
    out = ctl.collect(drawer(tok), groups=1, n=2, sampling=SAMPLING)
    crashed = next(s for s in out if index(s) == 1)
    assert crashed.failed and "injected crash" in crashed.meta["error"]
    # a crash of the drive itself (the prompt source raises on a refill): everything is closed, no leak
    calls = {"n": 0}

    def flaky(k):
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError("dataset went away")
        return prompts(tok, 1, start=50)

    with pytest.raises(OSError, match="went away"):
        ctl.collect(flaky, groups=3, n=2, sampling=SAMPLING)
    assert env.live() == [] and engine.in_flight == 0
    assert set(env.closes) == set(env.opened) and all(c == 1 for c in env.closes.values())
    ctl.close()


def test_context_overflow_is_an_infrastructure_failure(engine, tok):
    env = CountdownEnv(lambda s: 5)
    ctl = make(engine, tok, env)
    tight = SamplingParams(max_new_tokens=6, temperature=1.0, max_response_tokens=40)
    out = ctl.collect(drawer(tok), groups=1, n=2, sampling=tight)
    ctl.close()
    assert all(s.failed and "context overflow" in s.meta["error"] for s in out)
    assert all(len(s.response_ids) <= 40 for s in out)


def test_pool_and_engine_concurrency_caps_are_distinct(engine, tok):
    seen = []
    env = CountdownEnv(lambda s: 2, probe=lambda: seen.append(engine.in_flight))
    ctl = make(engine, tok, env, workers=2, trajectories_per_worker=2, max_inflight_requests=3)
    out = ctl.collect(drawer(tok), groups=4, n=2, sampling=SAMPLING)
    ctl.close()
    assert len(out) == 8
    assert env.peak == 4  # the pool: workers * trajectories_per_worker live trajectories at most
    assert max(seen) <= 3  # the engine: at most max_inflight_requests turns submitted


def test_auto_tail_follows_the_environment_contract_and_warm_start_traces(engine, tok):
    class Stateful(CountdownEnv):
        stateful = True

    assert make(engine, tok, CountdownEnv(lambda s: 1)).tail == "carry"
    ctl = make(engine, tok, Stateful(lambda s: 1))
    assert ctl.tail == "drop"
    p = Sample(id="p1", prompt_ids=tok.encode("Q: 12*34=? A:"), prompt_text="Q: 12*34=? A:", answer=408)
    (plain,) = ctl.warm_start_samples([p])  # warm_start: answer
    assert tok.decode(plain.response_ids) == " 408" + tok.decode([tok.eos_token_id]) and set(plain.loss_mask) == {1}
    ctl.close()
    ctl = make(engine, tok, CountdownEnv(lambda s: 1), warm_start="calculator")
    (trace,) = ctl.warm_start_samples([p])
    assert [g.kind for g in trace.segments] == ["model", "observation", "model"]
    obs = trace.segments[1]
    assert set(trace.loss_mask[obs.start:obs.end]) == {0} and "408" in tok.decode(trace.response_ids[obs.start:obs.end])
    ctl.close()


def test_carried_tail_survives_a_checkpoint_and_resumes_in_a_fresh_controller(engine, tok, tmp_path):
    """state_dict -> torch.save/load (what the trainer's checkpoint does) -> a fresh controller and a fresh
    environment: the tail resumes at its turn boundary with its tokens intact, nothing drawn is lost."""
    env = CountdownEnv(lambda s: 1 if prompt_index(s) == 0 else 4)
    ctl = make(engine, tok, env, over_generate=3.0, tail="carry")
    first = ctl.collect(drawer(tok), groups=1, n=2, sampling=SAMPLING)
    assert {s.prompt_id for s in first} == {"p0"} and ctl.last.carried == 4
    state = ctl.state_dict()
    saved = {s.id: s.copy() for s in state["live"]}
    assert {s.prompt_id for s in saved.values()} == {"p1", "p2"} and all(s.turns >= 1 for s in saved.values())
    torch.save(state, tmp_path / "extra.pt")
    ctl.close()  # the process dies: the old controller's trajectories are closed, never resumed by it
    assert env.live() == []

    env2 = CountdownEnv(lambda s: 1 if prompt_index(s) == 0 else 4)
    ctl2 = make(engine, tok, env2, over_generate=3.0, tail="carry")
    ctl2.load_state_dict(torch.load(tmp_path / "extra.pt", weights_only=False))
    second = ctl2.collect(drawer(tok, start=100), groups=2, n=2, sampling=SAMPLING)
    assert {s.prompt_id for s in second} == {"p1", "p2"}  # the carried groups complete first
    for s in second:
        before = saved[s.id]
        assert s.response_ids[:len(before.response_ids)] == before.response_ids  # resumed, not regenerated
        assert s.rollout_logprobs[:len(before.rollout_logprobs)] == before.rollout_logprobs
        assert s.turns == 4 and len(s.requests) == 4
        s.validate()
    assert set(env2.opened) == set(saved) | {s.id for s in ctl2._pool.backlog} | set(env2.live()) | set(env2.closes)
    third = ctl2.collect(drawer(tok, start=100), groups=1, n=2, sampling=SAMPLING)
    # the drive counter resumed: groups launched after the restore are tagged drive 2 or 3, never 1 again
    assert {s.group_id.rpartition("@agentic")[2].split(".")[0] for s in third} <= {"2", "3"}
    ctl2.close()
    assert env2.live() == [] and all(c == 1 for c in env2.closes.values())
    with pytest.raises(RuntimeError, match="fresh controller"):
        ctl2.load_state_dict(state)


def test_a_stateful_tail_refuses_the_checkpoint_and_a_dropped_one_saves_nothing_live(engine, tok):
    class Stateful(CountdownEnv):
        stateful = True

    ctl = make(engine, tok, Stateful(lambda s: 1 if prompt_index(s) == 0 else 4), over_generate=3.0, tail="carry")
    ctl.collect(drawer(tok), groups=1, n=2, sampling=SAMPLING)
    with pytest.raises(RuntimeError, match="tail: auto or drop"):
        ctl.state_dict()
    ctl.close()
    ctl = make(engine, tok, Stateful(lambda s: 1 if prompt_index(s) == 0 else 4), over_generate=3.0)  # auto: drop
    ctl.collect(drawer(tok), groups=1, n=2, sampling=SAMPLING)
    state = ctl.state_dict()
    ctl.close()
    assert state["live"] == [] and state["pending"] == [] and state["drive"] == 1


def test_an_eval_controller_samples_the_same_seeds_every_drive_and_a_train_one_does_not(engine, tok):
    def tokens(out):
        return sorted((s.prompt_id, index(s), tuple(s.response_ids)) for s in out)

    for repeat in (True, False):
        ctl = AgenticRolloutController(engine, CountdownEnv(lambda s: 1), tok, reward_fn=lambda text, s: 0.0,
                                       options=AgenticOptions(), tag="eval", base_seed=7, repeat_seeds=repeat)
        a = ctl.collect(drawer(tok), groups=2, n=2, sampling=SAMPLING)
        b = ctl.collect(drawer(tok), groups=2, n=2, sampling=SAMPLING)  # the same prompts, the next drive
        ctl.close()
        assert {s.group_id for s in a}.isdisjoint(s.group_id for s in b)  # ids stay unique per drive
        assert (tokens(a) == tokens(b)) is repeat


def test_warm_start_tool_share_calls_the_tool_in_exactly_that_share_of_a_batch(tok):
    ps = [Sample(id=f"p{i}", prompt_ids=tok.encode(f"Q: {i}*3=? A:"), prompt_text=f"Q: {i}*3=? A:", answer=3 * i)
          for i in range(8)]
    # traces are built without the engine (SFT runs before any rollout)
    ctl = make(None, tok, CountdownEnv(lambda s: 1), warm_start="calculator", warm_start_tool_share=0.25)
    traces = ctl.warm_start_samples(ps)
    ctl.close()
    calls = [any(g.kind == "observation" for g in s.segments) for s in traces]
    assert calls == [False, False, False, True] * 2  # floor((i+1)/4) > floor(i/4): i = 3, 7
    for s, p in zip(traces, ps, strict=True):
        s.validate()
        assert s.response_ids[-1] == tok.eos_token_id
        assert tok.decode(s.response_ids[:-1]).endswith(str(p.answer))  # both kinds end with the answer
