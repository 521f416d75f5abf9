"""The sample tree: lineage in the id survives split, concat, shuffle and sharding."""

import math

import pytest

from unirl.kernel.errors import SampleError
from unirl.samples import Sample, expand, groups, launch, shuffle, split, stable_seed


def prompts(k=5, plen=3):
    return [Sample(id=f"p{i}", prompt_ids=list(range(plen + i))) for i in range(k)]


def test_expand_makes_launch_tagged_sibling_ids_and_request_keyed_seeds():
    kids = expand(prompts(2), 3, tag="train-4", base_seed=7)
    assert [s.id for s in kids] == [f"p{i}@train-4/{j}" for i in range(2) for j in range(3)]
    assert {s.group_id for s in kids} == {"p0@train-4", "p1@train-4"} and kids[4].parent_id == "p1@train-4"
    assert {s.prompt_id for s in kids} == {"p0", "p1"}
    # the seed is a function of the request id alone
    assert kids[0].seed == stable_seed(7, "p0@train-4/0") and len({s.seed for s in kids}) == 6
    again = expand(prompts(2), 3, tag="train-4", base_seed=7)
    assert [s.seed for s in again] == [s.seed for s in kids]
    # another launch: fresh ids and fresh seeds; the batch around a prompt does not matter
    assert expand(prompts(2), 3, tag="train-5", base_seed=7)[0].seed != kids[0].seed
    assert expand(prompts(2)[1:], 3, tag="train-4", base_seed=7)[0].seed == kids[3].seed
    assert all(s.seed is None for s in expand(prompts(2), 3, tag="train-4"))


def test_eval_seed_tag_keeps_seeds_across_launches():
    a = expand(prompts(1), 2, tag="eval-0", base_seed=3, seed_tag="eval")
    b = expand(prompts(1), 2, tag="eval-9", base_seed=3, seed_tag="eval")
    assert [s.id for s in a] != [s.id for s in b]
    assert [s.seed for s in a] == [s.seed for s in b]


def test_two_launches_of_one_prompt_never_merge():
    first = expand(prompts(2), 2, tag="train-0", base_seed=1)
    second = expand(prompts(2), 2, tag="train-1", base_seed=1)
    g = groups(shuffle(first + second, seed=0))
    assert set(g) == {"p0@train-0", "p1@train-0", "p0@train-1", "p1@train-1"}
    assert all(len(members) == 2 for members in g.values())
    assert all(len({s.id.partition("/")[0] for s in m}) == 1 for m in g.values())
    assert not {s.id for s in first} & {s.id for s in second}  # a request id never repeats
    assert not {s.seed for s in first} & {s.seed for s in second}


def test_group_id_is_independent_of_turn_depth():
    root = expand(prompts(1), 1, tag="train-2")[0]
    deeper = root.child(0).child(3)
    assert deeper.id == "p0@train-2/0/0/3" and deeper.depth == 3
    assert root.group_id == deeper.group_id == "p0@train-2"
    assert groups([root, deeper]) == {"p0@train-2": [root, deeper]}


def test_turn_seed_is_keyed_on_the_request_and_its_depth():
    s = Sample(id="p0@t/0", prompt_ids=[1, 2], seed=11)
    assert s.turn_seed() == 11
    s.append_model_turn([5, 6], [-1.0, -1.0], 0, "stop")
    s.append_observation([7])
    assert s.turn_seed() == stable_seed(11, 3)
    twin = Sample(id="p0@t/0", prompt_ids=[1, 2], seed=11)
    twin.append_model_turn([5, 6], [-1.0, -1.0], 0, "stop")
    twin.append_observation([7])
    assert twin.turn_seed() == s.turn_seed()
    assert Sample(id="x", prompt_ids=[1]).turn_seed() is None


def test_launch_rejects_lineage_characters():
    with pytest.raises(SampleError):
        launch(Sample(id="p0/1", prompt_ids=[1]), "train-0")
    with pytest.raises(SampleError):
        expand(prompts(1), 1, tag="a/b")


def test_groups_survive_shuffle_split_and_concat():
    kids = expand(prompts(6), 4, tag="train-0")
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
    kids = expand(prompts(8), 2, tag="train-0")
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
    s = Sample(id="p0/0", prompt_ids=[1], response_ids=[1, 2], loss_mask=[1], rollout_logprobs=[0, 0],
               versions=[1, 1], status="ok")
    with pytest.raises(SampleError, match=r"sample p0/0 from torch is malformed: loss_mask has 1 entries"):
        s.validate(source="torch")


def test_validate_checks_segments_against_masks():
    s = Sample(id="p0@t/0", prompt_ids=[1])
    s.append_model_turn([3, 4], [-0.5, -0.25], 2, "stop")
    s.append_observation([9, 9])
    s.append_model_turn([5], [-1.0], 2, "length")
    s.validate(source="torch")
    assert s.status == "truncated" and s.turns == 2
    s.loss_mask[2] = 1  # an observation token marked as the policy's
    with pytest.raises(SampleError, match="observation segment 2:4 must have loss_mask 0"):
        s.validate(source="torch")
