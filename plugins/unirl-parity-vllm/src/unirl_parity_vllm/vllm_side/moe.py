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

The bindings are per instance (nothing in vLLM's classes changes) and are verified right after the
build: a block vLLM would serve through another path (shared experts, expert parallelism, EPLB,
sequence-parallel MoE, a non-CPU experts class) fails the build with
:class:`~unirl_parity_vllm.vllm_side.kernels.ParityKernelError`.

**Routing record.** While :data:`RECORD` is on (``UNIRL_PARITY_MOE_RECORD=1`` in the engine
process, or set by a test), every call appends ``(layer, positions, ids)``: the absolute position of
each row and its top-k expert ids, in the order vLLM scheduled them. :func:`drain` hands the calls
out. See ``docs/parity.md`` ("MoE") for how the diagnostics use it.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch

from unirl_parity_vllm.vllm_side.adapters import VLLMAdapter, validate_model

RECORD_ENV = "UNIRL_PARITY_MOE_RECORD"
#: record the routing of every call (see the module doc)
RECORD = os.environ.get(RECORD_ENV) == "1"
_CALLS: list[tuple[int, torch.Tensor]] = []


def drain() -> list[tuple[int, torch.Tensor]]:
    """The recorded ``(layer, ids [rows, k])`` calls since the last drain, in call order."""
    out = list(_CALLS)
    _CALLS.clear()
    return out


def _refuse(what: str) -> None:
    from unirl_parity_vllm.vllm_side.kernels import ParityKernelError

    raise ParityKernelError(f"unirl-parity-vllm (moe): {what}; parity cannot be exact, refusing to serve")


def moe_block_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Qwen3MoeSparseMoeBlock.forward`` under parity (module doc)."""
    from unirl_parity_vllm import moe

    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    gate_w = self.gate.weight
    experts = self.experts.routed_experts
    w13, w2 = experts.w13_weight, experts.w2_weight
    if gate_w.ndim != 2 or gate_w.numel() == 0:
        _refuse(f"router weight of shape {tuple(gate_w.shape)} (packed by another GEMM dispatch?)")
    if w13.ndim != 3 or w13.shape[1] != 2 * w2.shape[2] or w13.shape[2] != x.shape[-1]:
        _refuse(f"expert weights of shapes {tuple(w13.shape)} / {tuple(w2.shape)} are not in checkpoint layout")
    _, weights, ids = moe.route(x, gate_w, self._unirl_top_k, self._unirl_renormalize)
    if RECORD:
        _CALLS.append((self._unirl_layer, ids.to("cpu", copy=True)))
    return moe.expert_combine(x, ids, weights, w13, w2).reshape(shape)


def keep_plain(self: Any, layer: torch.nn.Module) -> None:
    """``process_weights_after_loading`` of a routed-experts layer under parity: keep the weights as
    loaded (the parity combine reads them in checkpoint layout; nothing to pack)."""
    layer._unirl_parity_plain = True


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
        if mod.is_sequence_parallel or mod.enable_eplb or mod.ep_size != 1 or mod.tp_size != 1:
            problems.append(f"{name}: expert / tensor / sequence parallel MoE is not covered")
        routed = mod.experts.routed_experts
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
    return problems


class MoEVLLMAdapter(VLLMAdapter):
    """``qwen3_moe``: the built model's sparse blocks are bound (:func:`bind_model`), then validated."""

    def wrap_init(self, original, on_built):
        name = self.name

        def __init__(self_model: Any, *, vllm_config: Any, prefix: str = "") -> None:  # noqa: N807
            original(self_model, vllm_config=vllm_config, prefix=prefix)
            moe_report = bind_model(self_model, vllm_config)
            report = validate_model(self_model, vllm_config, covered=frozenset(moe_report["covered"]))
            on_built(name, self_model, {**report, "moe": moe_report})

        __init__.__qualname__ = f"{self.cls}.__init__"
        __init__.__module__ = __name__
        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        __init__._unirl_parity_adapter = name  # type: ignore[attr-defined]
        return __init__


def qwen3_moe_adapter() -> VLLMAdapter:
    return MoEVLLMAdapter(name="qwen3_moe", module="vllm.model_executor.models.qwen3_moe", cls="Qwen3MoeForCausalLM",
                          checks=[_qwen3_moe_checks])
