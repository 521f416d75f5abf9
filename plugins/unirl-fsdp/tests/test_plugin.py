"""The plugin's registration, options and preflight: no Ray, no model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from unirl.api import RunConfig, load_kernel
from unirl.preflight import preflight


def fsdp_config(**options) -> RunConfig:
    return RunConfig.model_validate({"actor": {"name": "fsdp", "options": options},
                                     "rollout": {"n": 2}, "trainer": {"prompts_per_step": 2}})


def test_registered_lazily_without_importing_torch_or_ray():
    kernel = load_kernel()
    entry = kernel.get("actors", "fsdp")
    assert entry.dist == "unirl-fsdp" and entry.factory == "unirl_fsdp.actor:FSDPActor"
    code = "import sys, unirl_fsdp.plugin, unirl_fsdp.options; print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_options_validated_against_config_model():
    from unirl_fsdp.options import FSDPOptions

    kernel = load_kernel()
    assert kernel.get("actors", "fsdp").load().Config is FSDPOptions
    bad = preflight(fsdp_config(world_size=2, cpus_per_rank=0.5, wold_size=3), kernel)
    # once, from the kernel's validation against FSDPActor.Config (the plugin's preflight reads the same)
    assert [(v.source, v.field) for v in bad if v.field.startswith("actor.options")] == [
        ("unirl-fsdp", "actor.options.wold_size")]


def test_preflight_catches_unplaceable_group_and_bad_combinations(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    kernel = load_kernel()
    found = {v.field: v for v in preflight(fsdp_config(world_size=64, device="cpu", backend="nccl",
                                                       cpu_offload=True), kernel) if v.source == "unirl-fsdp"}
    assert set(found) == {"actor.options.world_size", "actor.options.backend", "actor.options.cpu_offload"}
    assert "64 ranks" in found["actor.options.world_size"].message
    ok = [v for v in preflight(fsdp_config(world_size=2, cpus_per_rank=0.5), kernel) if v.source == "unirl-fsdp"]
    assert ok == []
    other = RunConfig.model_validate({"actor": {"name": "torch"}})
    assert [v for v in preflight(other, kernel) if v.source == "unirl-fsdp"] == []


def test_lora_passes_preflight(monkeypatch):
    """The FSDP actor trains ``actor.lora`` (tests/test_lora_fsdp.py); preflight no longer refuses it."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = RunConfig.model_validate({"actor": {"name": "fsdp", "lora": {"r": 4}, "options": {"world_size": 2,
                                       "cpus_per_rank": 0.5}}, "rollout": {"n": 2}, "trainer": {"prompts_per_step": 2}})
    assert [v for v in preflight(config, load_kernel()) if v.source == "unirl-fsdp"] == []


def test_no_actor_or_rank_builds_a_kernel():
    """One kernel per run: the actors, the ranks and the skeleton take the trainer's runtime, which is
    required (no fallback to a default runtime, which would discover a kernel of its own)."""
    import inspect

    pytest.importorskip("ray")
    import unirl.actor.checkpoint
    import unirl.actor.skeleton
    import unirl.actor.torch_actor
    import unirl_fsdp.actor
    import unirl_fsdp.group
    import unirl_fsdp.worker

    for mod in (unirl.actor.skeleton, unirl.actor.torch_actor, unirl.actor.checkpoint, unirl_fsdp.actor,
                unirl_fsdp.worker, unirl_fsdp.group):
        src = inspect.getsource(mod)
        assert "load_kernel" not in src and "GROUP_ESTIMATORS" not in src, mod.__name__
        assert "default_runtime(" not in src, mod.__name__  # no fallback call
        assert "unirl.preflight" not in src, mod.__name__


def test_worker_cls_option_is_checked():
    pytest.importorskip("ray")
    from unirl.api import UniRLError
    from unirl_fsdp.group import resolve_worker_cls
    from unirl_fsdp.options import FSDPOptions
    from unirl_fsdp.worker import FSDPWorker

    assert resolve_worker_cls(None) == (FSDPWorker, None)
    with pytest.raises(UniRLError, match="worker_cls"):
        resolve_worker_cls("no_such_module_xyz:Worker")
    with pytest.raises(UniRLError, match="not a subclass"):
        resolve_worker_cls("unirl_fsdp.options:FSDPOptions")
    with pytest.raises(ValueError):
        FSDPOptions(worker_cls="not a spec")
