"""The FSDP actor's declared memory (unirl_fsdp.memory_layout) against hand arithmetic: on the CPU each rank
carries the backward blocks glibc's heap keeps (per decoder-layer parameter: fp32 gradient + fp32
reduce-scatter input in fp32, the input alone in bf16, the compute-dtype gradient at one rank), rank 0 alone stages the weight stream (2 buckets, at
most the model), and on a GPU neither heap term is declared (CUDA's caching allocator reuses blocks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from unirl.api import load_config, load_kernel
from unirl.memory_plan.plan import plan

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "arith-tiny-fsdp.yaml"
BUILD = ("model.build={hidden_size: 256, intermediate_size: 768, num_hidden_layers: 4, num_attention_heads: 4, "
         "num_key_value_heads: 2, head_dim: 64}")
#: that build's parameters by hand: 4 layers x (attention 256x256 + 2x256x128 + 256x256 + q/k norms 2x64
#: + MLP 3x256x768 + 2 norms 2x256) + tied embedding 259x256 + final norm 256
LAYER_PARAMS = 4 * (65536 + 65536 + 65536 + 128 + 589824 + 512)
PARAMS = LAYER_PARAMS + 259 * 256 + 256


def _items(overrides: list[str]) -> dict[str, dict[str, int]]:
    config = load_config(RECIPE, [BUILD, *overrides])
    kernel = load_kernel()
    p = plan(config, kernel, kernel.get("model_adapters", config.model.adapter).load()())
    return {d.device: {i.name: i.bytes for comp, i in d.items if comp == "actor"} for d in p.devices}


@pytest.mark.parametrize(("ranks", "dtype", "per_param"), [(2, "float32", 4 + 4), (4, "bfloat16", 4),
                                                             (1, "float32", 4)])
def test_cpu_ranks_declare_the_heap_term(ranks, dtype, per_param) -> None:
    got = _items([f"actor.options={{world_size: {ranks}, compute_dtype: {dtype}, device: cpu}}"])
    for k in range(ranks):
        assert got[f"rank {k}"]["backward blocks the heap keeps"] == per_param * LAYER_PARAMS
    assert got["rank 0"]["weight stream staging (rank 0)"] == min(2 * 64 * 2**20, 4 * PARAMS)
    assert all("weight stream staging (rank 0)" not in got[f"rank {k}"] for k in range(1, ranks))


def test_gpu_ranks_declare_no_heap_term() -> None:
    got = _items(["actor.options={world_size: 2, device: cuda, bucket_mb: 1}", "run.memory_budget_gb=80"])
    assert all("backward blocks the heap keeps" not in got[f"gpu:{k}"] for k in range(2))
    assert got["rank 0 (host)"] == {"weight stream staging (rank 0)": 2 * 2**20}
