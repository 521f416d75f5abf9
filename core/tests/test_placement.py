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


STALE_DRIVER = r"""
import time, ray
from ray._private.services import canonicalize_bootstrap_address
from unirl.api import connect_ray
# the precondition: a bare ray.init() here would dial the dead address the stale file names
assert canonicalize_bootstrap_address(None).endswith(":1"), canonicalize_bootstrap_address(None)
t = time.monotonic()
assert connect_ray(loopback=True, log_to_driver=False) is True  # started (and so owns) a fresh Ray
assert ray.cluster_resources().get("CPU", 0) > 0
assert connect_ray() is False  # already initialised: joins the caller's session, owns nothing
print(f"ok {time.monotonic() - t:.1f}")
ray.shutdown()
"""


@pytest.mark.ray
def test_connect_ray_ignores_a_stale_ray_current_cluster(tmp_path):
    """A cluster that died without cleaning up leaves ``ray_current_cluster`` behind; a bare
    ``ray.init()`` dials it and fails only after ~15 minutes (CI saw exactly that). ``connect_ray``
    starts its own local Ray instead."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    pytest.importorskip("ray")
    short = tempfile.mkdtemp(prefix="ur", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    try:
        os.makedirs(os.path.join(short, "ray"))
        with open(os.path.join(short, "ray", "ray_current_cluster"), "w") as f:
            f.write("127.0.0.1:1")  # nothing listens on port 1
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": short}
        out = subprocess.run([sys.executable, "-c", STALE_DRIVER], env=env, capture_output=True, text=True,
                             timeout=240)
        assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
    finally:
        shutil.rmtree(short, ignore_errors=True)
