"""FSDP test set-up: ``fsdp_support`` importable by name (and by the ranks), one Ray per module."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # pytest's importlib mode does not put test directories on sys.path
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray with 2 CPUs for the module's rank groups (each group reserves 2 x 0.5 CPUs)."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False,
             log_to_driver=False)
    yield
    ray.shutdown()
