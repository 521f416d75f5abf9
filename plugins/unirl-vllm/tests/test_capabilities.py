"""vLLM declares the layout it will run with (issue 72), read from its validated options the way
``_llm_kwargs`` applies them (``engine_args`` last), so parity and the memory plan never re-read them."""

from __future__ import annotations

from unirl.api import RunConfig
from unirl_vllm.engine import VLLMEngine
from unirl_vllm.options import VLLMOptions


def test_defaults_declare_one_eager_worker_with_prefix_cache():
    caps = VLLMEngine.capabilities(RunConfig(), VLLMOptions())
    assert (caps.workers, caps.tensor_parallel, caps.serve_dtype) == (1, 1, None)
    assert (caps.eager, caps.prefix_cache, caps.chunked_prefill) == (True, True, True)
    assert caps.logprobs_mode == VLLMOptions().logprobs_mode == caps.served_logprobs
    assert caps.field_of("eager") == "rollout.options.enforce_eager"
    assert caps.batching == "continuous"  # what lets a trace replay predict its per-request latency


def test_engine_args_apply_last():
    opts = VLLMOptions.model_validate({"replicas": 2, "placement": "ray", "logprobs_mode": "raw_logprobs",
                                       "engine_args": {"tensor_parallel_size": 2, "dtype": "bf16",
                                                       "enable_chunked_prefill": False, "enforce_eager": False}})
    caps = VLLMEngine.capabilities(RunConfig(), opts)
    assert (caps.workers, caps.tensor_parallel, caps.serve_dtype) == (4, 2, "bfloat16")
    assert (caps.eager, caps.chunked_prefill, caps.logprobs, caps.served_logprobs) == (
        False, False, "raw", "raw_logprobs")
    assert caps.field_of("tensor_parallel") == "rollout.options.tensor_parallel_size"  # the option users set
    assert caps.field_of("serve_dtype") == "rollout.options.engine_args.dtype"


def test_the_memory_plan_reads_the_declared_layout():
    """One source: the memory plan sizes the TP workers and the dtype that the capabilities declare,
    engine_args included (it read ``tensor_parallel_size`` and ``model.dtype`` on its own before)."""
    from unirl.api import ModelFacts

    facts = ModelFacts(vocab=100, hidden=64, layers=2, intermediate=128, heads=2, kv_heads=1, head_dim=32, tied=True)
    opts = VLLMOptions.model_validate({"engine_args": {"tensor_parallel_size": 2, "dtype": "bfloat16"}})
    layout = VLLMEngine.memory_layout(RunConfig(), opts, facts)
    workers = [load for load in layout.loads if load.device.startswith("engine worker")]
    assert len(workers) == VLLMEngine.capabilities(RunConfig(), opts).tensor_parallel == 2
    assert "bfloat16" in workers[0].items[0].name
