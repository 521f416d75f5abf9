"""A checkpoint's carried tail is pickled Samples (``extra.pt``). One pickled before Parts existed (a
``segments`` field, no ``spans``) must unpickle into the same Parts, so a run checkpointed by the older
release resumes; a current one (fork branch, payload) round-trips whole. Oracle: the sample as built."""

from __future__ import annotations

import copyreg
import io
import pickle

from unirl.samples import Part, Sample, Segment


def _trajectory() -> Sample:
    s = Sample(id="p1@train0.0/0", prompt_ids=[1, 2], seed=4)
    s.append_model_turn([3, 4], [-0.1, -0.2], 1, "stop")
    s.append_observation([5])
    return s


def _pickled_as_before_parts(s: Sample) -> bytes:
    """The bytes pickle wrote for ``s`` when Sample had a ``segments`` field (its __dict__ as state)."""
    state = {k: v for k, v in s.__dict__.items() if k != "spans"}
    state["segments"] = [Segment("model", 0, 0, 2), Segment("observation", 0, 2, 3)]

    class Old(pickle.Pickler):
        def reducer_override(self, obj):
            return (copyreg.__newobj__, (Sample,), state) if obj is s else NotImplemented

    buf = io.BytesIO()
    Old(buf).dump(s)
    return buf.getvalue()


def test_a_sample_pickled_before_parts_unpickles_into_the_same_parts():
    s = _trajectory()
    old = pickle.loads(_pickled_as_before_parts(s))
    assert old.parts == s.parts and old.spans == s.spans and old.turns == 1
    branch = old.fork(1)  # and it goes on as a current sample: forks, grows
    branch.append_model_turn([6], [-0.3], 2, "stop")
    assert branch.id == "p1@train0.0/0/f1.1" and branch.parts[:3] == s.parts


def test_a_fork_branch_with_a_payload_round_trips_through_pickle():
    s = _trajectory()
    b = s.fork(0)
    b.append_part(Part("image", [], turn=0, payload={"ref": "img-7"}))
    b.append_model_turn([8, 9], [-0.5, -0.25], 2, "length")
    b.reward = 0.5  # (NaN, the unscored default, is never equal to itself)
    back = pickle.loads(pickle.dumps(b))
    assert back == b and back.parts == b.parts and back.fork_group_id == "p1@train0.0/0/f1"
