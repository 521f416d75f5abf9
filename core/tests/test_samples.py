"""The sample tree: lineage in the id survives split, concat, shuffle and sharding."""

import math

from unirl.samples import Sample, expand, groups, shuffle, split, stable_seed


def prompts(k=5, plen=3):
    return [Sample(id=f"p{i}", prompt_ids=list(range(plen + i))) for i in range(k)]


def test_expand_makes_sibling_ids_and_stable_seeds():
    kids = expand(prompts(2), 3, base_seed=7, step=4)
    assert [s.id for s in kids] == ["p0/0", "p0/1", "p0/2", "p1/0", "p1/1", "p1/2"]
    assert {s.group_id for s in kids} == {"p0", "p1"} and kids[4].parent_id == "p1"
    assert kids[0].seed == stable_seed(7, 4, "p0/0") and len({s.seed for s in kids}) == 6
    again = expand(prompts(2), 3, base_seed=7, step=4)
    assert [s.seed for s in again] == [s.seed for s in kids]
    assert expand(prompts(2), 3, base_seed=7, step=5)[0].seed != kids[0].seed


def test_groups_survive_shuffle_split_and_concat():
    kids = expand(prompts(6), 4)
    mixed = shuffle(kids, seed=3)
    assert [s.id for s in mixed] != [s.id for s in kids]
    parts = split(mixed, 2, keep_groups=True)
    for part in parts:
        for gid, members in groups(part).items():
            assert len(members) == 4, f"group {gid} was split across ranks"
    rejoined = [s for part in parts for s in part]
    assert {g: sorted(s.id for s in m) for g, m in groups(rejoined).items()} == {
        g: sorted(s.id for s in m) for g, m in groups(kids).items()
    }


def test_split_balances_tokens():
    kids = expand(prompts(8), 2)
    a, b = split(kids, 2)
    ta, tb = sum(s.num_tokens for s in a), sum(s.num_tokens for s in b)
    biggest_group = max(sum(s.num_tokens for s in g) for g in groups(kids).values())
    assert abs(ta - tb) <= biggest_group


def test_failed_sample_has_nan_reward_and_reason():
    s = Sample(id="p0/0", prompt_ids=[1])
    s.reward = 1.0
    s.mark_failed("engine crashed")
    assert s.failed and math.isnan(s.reward) and s.meta["error"] == "engine crashed"


def test_validate_catches_misaligned_token_lists():
    s = Sample(id="p0/0", prompt_ids=[1], response_ids=[1, 2], loss_mask=[1], rollout_logprobs=[0, 0], versions=[1, 1])
    try:
        s.validate()
    except ValueError as exc:
        assert "loss_mask" in str(exc)
    else:
        raise AssertionError("misaligned sample passed validation")
