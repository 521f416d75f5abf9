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
verified right after the build: a block vLLM would serve through another path (shared experts, expert parallelism, EPLB,
sequence-parallel MoE, a non-CPU experts class) fails the build with
:class:`~unirl_parity_vllm.vllm_side.kernels.ParityKernelError`.

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
    """``Qwen3MoeSparseMoeBlock.forward`` under parity (module doc). Under TP the full experts are gathered
    once per weight version when the profile's ``tp_gather_cache`` is on (:func:`keep_plain` drops them)."""
    from unirl_parity_vllm import moe_ops as moe
    from unirl_parity_vllm.vllm_side import tp_gather_cache

    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    gate_w = self.gate.weight
    experts = self.experts.routed_experts
    w13, w2 = experts.w13_weight, experts.w2_weight
    if int(self.tp_size) > 1:
        full = getattr(experts, "_unirl_full_experts", None)
        if full is None:
            full = gather_experts(w13, w2)
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
    for name, mod in model.named_modules():
        if not isinstance(mod, vm.Qwen3MoeSparseMoeBlock):
            continue
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else len(blocks)
        if mod.shared_expert is not None:
            problems.append(f"{name}: shared experts are not covered")
        routed = mod.experts.routed_experts
        # the block's ep_group spans the TP ranks even without EP; whether experts are split is the
        # experts' own parallel config (TP without EP is covered: gather_experts)
        if mod.is_sequence_parallel or mod.enable_eplb or routed.moe_config.moe_parallel_config.use_ep:
            problems.append(f"{name}: expert / sequence parallel MoE is not covered")
        if routed.global_num_experts != routed.local_num_experts:
            problems.append(f"{name}: experts split across ranks ({routed.local_num_experts} of "
                            f"{routed.global_num_experts} local)")
        qm = routed.quant_method
        if type(qm).__name__ != "UnquantizedFusedMoEMethod":
            problems.append(f"{name}: experts quant method {type(qm).__name__} (only unquantized is covered)")
        mod._unirl_layer = layer
        mod._unirl_top_k = int(cfg.num_experts_per_tok)
        mod._unirl_renormalize = bool(cfg.norm_topk_prob)
        mod.forward = types.MethodType(moe_block_forward, mod)
        qm.process_weights_after_loading = types.MethodType(keep_plain, qm)
        blocks.append(name)
        covered.add(f"{name}.experts.routed_experts.quant_method")
    if not blocks:
        problems.append("no Qwen3MoeSparseMoeBlock found (the architecture changed?)")
    if problems:
        _refuse("the built model cannot run exactly:\n  - " + "\n  - ".join(problems))
    return {"moe_blocks": len(blocks), "top_k": int(cfg.num_experts_per_tok),
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
