"""The plugin's registration, options and preflight: no Ray, no model."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from unirl.config import RunConfig
from unirl.kernel import hookimpl, load_kernel
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
    assert any(v.field == "actor.options.wold_size" for v in bad)


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


def test_worker_env_merges_every_plugins_hook(monkeypatch):
    """Without an explicit ``worker_env`` the actor asks the kernel, which asks every plugin."""
    pytest.importorskip("torch")
    import unirl.kernel as kernel_mod
    from unirl_fsdp.actor import plugin_worker_env

    a = types.ModuleType("env_a")
    a.unirl_worker_env = hookimpl(lambda config: {"UNIRL_PARITY_ENABLE": "1"})
    b = types.ModuleType("env_b")
    b.unirl_worker_env = hookimpl(lambda config: {"OTHER_FLAG": "x"})
    real = kernel_mod.load_kernel
    monkeypatch.setattr(kernel_mod, "load_kernel", lambda: real(extra=[("env_a", a), ("env_b", b)]))
    env = plugin_worker_env(fsdp_config())
    assert env["UNIRL_PARITY_ENABLE"] == "1" and env["OTHER_FLAG"] == "x"
