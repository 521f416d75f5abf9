"""Registration, preflight and capabilities of the sglang plugin: no server is contacted here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from unirl.api import RunConfig, load_kernel


def _config(**sections) -> RunConfig:
    base = {"rollout": {"engine": "sglang", "options": {"servers": ["http://127.0.0.1:30000"]}},
            "weight_sync": {"name": "sglang"}}
    for key, value in sections.items():
        base.setdefault(key, {}).update(value)
    return RunConfig.model_validate(base)


def test_discovered_through_entry_point():
    from unirl.api import load_kernel

    kernel = load_kernel()
    engine = kernel.get("rollout_engines", "sglang")
    assert engine.dist == "unirl-sglang" and engine.factory == "unirl_sglang.engine:SGLangEngine"
    assert kernel.get("weight_syncs", "sglang").factory == "unirl_sglang.sync:SGLangWeightSync"


def test_plugin_module_imports_no_torch():
    code = ("import sys, unirl_sglang.plugin, unirl_sglang.options; "
            "assert 'torch' not in sys.modules and 'sglang' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_preflight_reports_bad_options_and_pairing():
    from unirl.api import load_kernel
    from unirl.preflight import preflight

    kernel = load_kernel()
    assert preflight(_config(), kernel) == []
    bad = _config(rollout={"options": {"servers": ["localhost:30000"], "max_concurency": 4}},
                  weight_sync={"name": "inprocess"})
    found = [v.field for v in preflight(bad, kernel)]
    # each bad option exactly once: the kernel's validation against SGLangEngine.Config, nothing else
    assert sorted(f for f in found if f.startswith("rollout.options")) == ["rollout.options.max_concurency",
                                                                            "rollout.options.servers"]
    # core's pairing check reads SGLangEngine.capabilities(config, options): from valid options only
    paired = _config(rollout={"options": {"servers": ["http://localhost:30000"]}}, weight_sync={"name": "inprocess"})
    assert "weight_sync.name" in {v.field for v in preflight(paired, kernel)}
    neither = _config(rollout={"options": {}})
    assert any(v.field.startswith("rollout.options") for v in preflight(neither, kernel))
    sync_typo = _config(weight_sync={"options": {"mode": "nccl"}})
    assert "weight_sync.options.mode" in {v.field for v in preflight(sync_typo, kernel)}


def test_preflight_launch_needs_sglang_and_raw_logprobs_for_rollout_old_logp():
    from unirl_sglang.plugin import unirl_preflight

    launch = _config(rollout={"options": {"launch": {"module": "no_such_sglang.launch_server"}}})
    assert [v.field for v in unirl_preflight(launch, load_kernel())] == ["rollout.options.launch.module"]
    processed = _config(rollout={"temperature": 0.7, "options": {"servers": ["http://h:1"], "original_logprobs": False}},
                        algorithm={"old_logp_source": "rollout"})
    assert [v.field for v in unirl_preflight(processed, load_kernel())] == ["rollout.options.original_logprobs"]
    assert unirl_preflight(RunConfig(), load_kernel()) == []  # not selected: silent


@pytest.mark.parametrize(("original", "temperature", "expected"),
                         [(True, 0.7, "raw"), (False, 1.0, "raw"), (False, 0.7, "processed")])
def test_capabilities_logprobs(original, temperature, expected):
    from unirl_sglang.engine import SGLangEngine
    from unirl_sglang.options import SGLangOptions

    cfg = _config(rollout={"temperature": temperature,
                           "options": {"servers": ["http://h:1"], "original_logprobs": original}})
    caps = SGLangEngine.capabilities(cfg, SGLangOptions.model_validate(cfg.rollout.options))
    assert caps.logprobs == expected and caps.weight_syncs == ("sglang",)
