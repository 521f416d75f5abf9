"""Placement options and the weight-transport choice, without Ray (the cluster tests are in
``tests/integration/test_cluster.py``)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from unirl.placement import Location, Placement
from unirl.sync.transport import choose_transport


def test_transport_follows_where_the_two_ends_are():
    me = Location("node-a", 10)
    assert choose_transport(me, Location("node-a", 10)) == "inprocess"
    assert choose_transport(me, Location("node-a", 11)) == "shm"  # same node, other process
    assert choose_transport(me, Location("node-b", 10)) == "object_store"  # a pid equal by chance
    assert choose_transport(Location(None, 10), Location(None, 11)) == "object_store"  # unknown: never tmpfs


def test_placement_bundles_and_validation():
    p = Placement(resources={"rollout": 1})
    assert p.bundles(2, {"CPU": 0.5, "GPU": 0}) == [{"CPU": 0.5, "rollout": 1.0}] * 2
    assert Placement().strategy == "PACK"  # defaults fill one node first
    for bad, match in (({"resources": {"GPU": 1}}, "set by the plugin's own options"),
                       ({"resources": {"rollout": 0}}, "must be > 0"),
                       ({"strategy": "RANDOM"}, "PACK"),
                       ({"node": "a"}, "Extra inputs")):
        with pytest.raises(ValidationError, match=match):
            Placement.model_validate(bad)
