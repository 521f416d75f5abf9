"""The per-version cache of the TP all-gathers (``plugins.parity.tp_gather_cache``): the logic, with the TP
group replaced by a recorder so that one process can play rank 0 or rank 1. That the cached weights are
the right ones, and are dropped at a weight sync, is the TP2 gates' job (``test_e2e_vllm_tp2.py``,
``test_e2e_vllm_bf16.py``: 0 mismatches at ``post_update_reload``, which a stale cache would fail)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from unirl_parity_vllm import ops  # noqa: E402
from unirl_parity_vllm.vllm_side import TP_CACHE_ENV, kernels, moe, tp_gather_cache  # noqa: E402  # noqa: E402


class _Group:
    """Two TP ranks' slices in one process: ``all_gather`` concatenates this rank's tensor with a copy
    (the other rank's slice); every call is recorded by the shape it gathered."""

    world_size = 2

    def __init__(self, rank: int) -> None:
        self.rank_in_group = rank
        self.calls: list[tuple[int, ...]] = []

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.calls.append(tuple(t.shape))
        return torch.cat([t, t + 1], dim=dim)


@pytest.fixture
def group(monkeypatch, request):
    g = _Group(getattr(request, "param", 0))
    import vllm.distributed

    monkeypatch.setattr(vllm.distributed, "get_tp_group", lambda: g)
    return g


def test_default_is_on_for_cpu_off_for_cuda_and_the_profile_decides(monkeypatch):
    monkeypatch.delenv(TP_CACHE_ENV, raising=False)
    monkeypatch.delenv("UNIRL_PARITY_PLATFORM", raising=False)
    assert tp_gather_cache()
    monkeypatch.setenv("UNIRL_PARITY_PLATFORM", "cuda")
    assert not tp_gather_cache()
    monkeypatch.setenv(TP_CACHE_ENV, "1")
    assert tp_gather_cache()
    monkeypatch.setenv("UNIRL_PARITY_PLATFORM", "cpu")
    monkeypatch.setenv(TP_CACHE_ENV, "0")
    assert not tp_gather_cache()


@pytest.mark.parametrize("group", [0, 1], indirect=True)
def test_row_parallel_weight_is_gathered_once_per_version_the_input_every_call(group):
    """Every rank makes the same collectives (or the other would hang), rank 0 keeps the weight; a new
    ParityLinear, which vLLM builds at every reload, gathers again. The result is the uncached one."""
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    plain = kernels.ParityLinear("RowParallelLinear", row_parallel=True)
    want = [plain(x, w) for _ in range(2)]
    assert group.calls == [(3, 4), (5, 4)] * 2  # uncached: input and weight, every call
    group.calls.clear()
    cached = kernels.ParityLinear("RowParallelLinear", row_parallel=True, cache=True)
    got = [cached(x, w) for _ in range(3)]
    assert group.calls == [(3, 4), (5, 4), (3, 4), (3, 4)]
    for a in got:
        torch.testing.assert_close(a, want[0], rtol=0, atol=0)
    if group.rank_in_group == 0:
        full = torch.cat([w, w + 1], dim=1)
        assert torch.equal(cached.full_weight, full)
        assert torch.equal(got[0], ops.linear(torch.cat([x, x + 1], dim=-1), full, None))
    else:
        assert cached.full_weight is None and torch.all(got[0] == 0) and torch.signbit(got[0]).all()
    group.calls.clear()
    reloaded = kernels.ParityLinear("RowParallelLinear", row_parallel=True, cache=True)
    reloaded(x, w + 2)
    assert group.calls == [(3, 4), (5, 4)]


def test_moe_experts_are_gathered_once_per_version_and_keep_plain_drops_them(group, monkeypatch):
    monkeypatch.delenv(TP_CACHE_ENV, raising=False)
    monkeypatch.delenv("UNIRL_PARITY_PLATFORM", raising=False)
    e, i, h = 4, 3, 8
    experts = torch.nn.Module()
    experts.w13_weight = torch.nn.Parameter(torch.randn(e, 2 * i, h), requires_grad=False)
    experts.w2_weight = torch.nn.Parameter(torch.randn(e, h, i), requires_grad=False)
    block = torch.nn.Module()
    block.gate = torch.nn.Linear(h, e, bias=False)
    block.experts = torch.nn.Module()
    block.experts.routed_experts = experts
    block.tp_size, block._unirl_layer, block._unirl_top_k, block._unirl_renormalize = 2, 0, 2, True
    x = torch.randn(5, h)
    with torch.no_grad():
        first = moe.moe_block_forward(block, x)
        assert len(group.calls) == 2  # w13 and w2, once
        second = moe.moe_block_forward(block, x)
        assert len(group.calls) == 2 and torch.equal(first, second)
        full13, full2 = moe.gather_experts(experts.w13_weight, experts.w2_weight)
        assert torch.equal(experts._unirl_full_experts[0], full13)
        moe.keep_plain(None, experts)  # what a weight sync's layerwise reload runs on the layer
        assert experts._unirl_full_experts is None
        group.calls.clear()
        moe.moe_block_forward(block, x)
        assert len(group.calls) == 2
        monkeypatch.setenv(TP_CACHE_ENV, "0")
        moe.keep_plain(None, experts)
        group.calls.clear()
        moe.moe_block_forward(block, x)
        moe.moe_block_forward(block, x)
        assert len(group.calls) == 4
