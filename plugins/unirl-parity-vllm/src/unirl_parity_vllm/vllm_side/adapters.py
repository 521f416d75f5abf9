"""Model adapters on the vLLM side: what one model family needs beyond the common providers.

For the model families here the common providers already cover every op (Qwen3's q/k norm is a
vLLM ``RMSNorm`` over ``[T, heads, head_dim]``, its RoPE is neox over the full head, its tied head
goes through the patched logits head). What an adapter adds is the *proof* for a built model: it
wraps the architecture's ``__init__`` so that, once vLLM has built the model, every layer is checked:

* every ``RMSNorm`` / ``SiluAndMul`` / ``RotaryEmbedding`` has its forward bound to the parity
  replacement (CustomOp binds the forward in ``__init__``: a late install would show here);
* no CustomOp the providers do not cover is present (unknown numerics are refused, not served);
* RoPE is plain neox over the full head; attention is plain causal decoder attention on the CPU
  backend (no sliding window, soft cap, ALiBi, sinks, fp8 KV cache);
* the engine runs eager (``enforce_eager=True``): torch.compile would fuse the reference ops.

A violation raises :class:`~unirl_parity_vllm.vllm_side.kernels.ParityKernelError` while the model
is built, before it serves a token. Third parties add a family with :func:`model_init_adapter`
through the ``unirl_parity.vllm_adapters`` entry-point group (each entry point is a zero-argument
callable returning a :class:`VLLMAdapter`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ENTRY_POINT_GROUP = "unirl_parity.vllm_adapters"


@dataclass
class VLLMAdapter:
    """Wraps ``module.cls.__init__`` with :func:`validate_model`; ``checks`` are extra phase-1 checks."""

    name: str
    module: str
    cls: str
    init_params: tuple[str, ...] = ("self", "vllm_config", "prefix")
    checks: list[Callable[[], list[str]]] = field(default_factory=list)

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.cls}.__init__"

    def preflight(self) -> list[str]:
        try:
            owner = getattr(importlib.import_module(self.module), self.cls)
            init = inspect.getattr_static(owner, "__init__")
        except Exception as exc:  # noqa: BLE001
            return [f"[adapter {self.name}] {self.module}.{self.cls} is missing ({type(exc).__name__}: {exc})"]
        problems = []
        have = tuple(inspect.signature(init).parameters)
        if have != self.init_params:
            problems.append(f"[adapter {self.name}] {self.qualname} has parameters {list(have)}, "
                            f"expected {list(self.init_params)}")
        for check in self.checks:
            problems.extend(f"[adapter {self.name}] {p}" for p in check())
        return problems

    def owner(self) -> Any:
        return getattr(importlib.import_module(self.module), self.cls)

    def extra_patches(self) -> list[tuple[Any, str, Callable[[Any], Any]]]:
        """More ``(owner, attribute, make)`` the installer replaces with ``make(original)`` (and puts
        back on uninstall), beyond the wrapped ``__init__``; none by default."""
        return []

    def bind(self, model: Any, vllm_config: Any) -> tuple[frozenset[str], dict[str, Any]]:
        """Called on a freshly built model before :func:`validate_model`: an adapter that takes modules
        over itself (MoE) binds them here and returns their names (``covered``) and its report entries."""
        return frozenset(), {}

    def wrap_init(self, original: Callable[..., None], on_built: Callable[[str, Any, dict], None]) -> Callable:
        name, bind = self.name, self.bind

        def __init__(self_model: Any, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:  # noqa: N807
            # extra keywords (Llama's ``layer_type``) pass through; preflight pinned their names
            original(self_model, vllm_config=vllm_config, prefix=prefix, **kwargs)
            covered, extra = bind(self_model, vllm_config)
            report = validate_model(self_model, vllm_config, covered=covered)
            on_built(name, self_model, {**report, **extra})

        __init__.__qualname__ = f"{self.cls}.__init__"
        __init__.__module__ = __name__
        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        __init__._unirl_parity_adapter = name  # type: ignore[attr-defined]
        return __init__


def _qwen3_checks() -> list[str]:
    """Qwen3's q/k norm must be vLLM's RMSNorm (the one the rmsnorm provider patches)."""
    try:
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.models import qwen3
    except Exception as exc:  # noqa: BLE001
        return [f"vllm.model_executor.models.qwen3 cannot be imported ({type(exc).__name__}: {exc})"]
    problems = []
    if getattr(qwen3, "RMSNorm", None) is not RMSNorm:
        problems.append("qwen3.RMSNorm is not vllm.model_executor.layers.layernorm.RMSNorm (q/k norm would escape)")
    attn = getattr(qwen3, "Qwen3Attention", None)
    if attn is None:
        problems.append("qwen3.Qwen3Attention is missing")
    else:
        params = tuple(inspect.signature(attn.forward).parameters)
        if params != ("self", "positions", "hidden_states"):
            problems.append(f"qwen3.Qwen3Attention.forward has parameters {list(params)}")
    return problems


def model_init_adapter(name: str, module: str, cls: str,
                       checks: list[Callable[[], list[str]]] | None = None,
                       init_params: tuple[str, ...] = ("self", "vllm_config", "prefix")) -> VLLMAdapter:
    """An adapter for a decoder-only family built from the covered layers (Qwen3, Llama, ...);
    ``init_params``: the exact parameter names of the architecture's ``__init__`` (Llama adds
    ``layer_type``), checked in phase 1."""
    return VLLMAdapter(name=name, module=module, cls=cls, init_params=tuple(init_params), checks=list(checks or []))


# ------------------------------------------------------------------------------------------ validation
def _bound_to(method: Any, fn: Any) -> bool:
    return getattr(method, "__func__", method) is fn


def _attention_problems(name: str, impl: Any) -> list[str]:
    """Why the attention layer ``name`` (its backend ``impl``) cannot run exactly: the reference ops
    cover vLLM's CPU backend for plain decoder attention only."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    if type(impl) is not CPUAttentionBackendImpl:
        return [f"{name}: attention backend {type(impl).__name__} (only CPU_ATTN is covered)"]
    bad = {k: v for k, v in {
        "attn_type": impl.attn_type if impl.attn_type != "decoder" else None,
        "sliding_window": impl.sliding_window if impl.sliding_window != -1 else None,
        "alibi": True if impl.alibi_slopes is not None else None,
        "soft_cap": impl.logits_soft_cap or None,
        "sinks": True if impl.sinks is not None else None,
        "kv_cache_dtype": impl.kv_cache_dtype if impl.kv_cache_dtype != "auto" else None,
        "kv_sharing": impl.kv_sharing_target_layer_name,
    }.items() if v is not None}
    return [f"{name}: attention features not covered: {bad}"] if bad else []


def validate_model(model: Any, vllm_config: Any, covered: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Check a freshly built vLLM model against the installed providers; raise on any gap.

    ``covered``: module names an adapter took over itself (e.g. the MoE adapter's bypassed fused-MoE
    methods); a CustomOp there is counted, not refused."""
    from vllm.config.compilation import CompilationMode
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding, RotaryEmbeddingBase
    from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb

    from unirl_parity_vllm.vllm_side import kernels

    problems: list[str] = []
    mode = vllm_config.compilation_config.mode
    if mode != CompilationMode.NONE:
        problems.append(f"compilation mode {getattr(mode, 'name', mode)}: parity needs enforce_eager=True "
                        "(torch.compile would fuse and reorder the reference ops)")
    counts: dict[str, int] = {}
    for name, m in model.named_modules():
        kind = None
        if isinstance(m, RMSNorm):
            kind = "rmsnorm"
            if type(m) is not RMSNorm:
                problems.append(f"{name}: {type(m).__name__} subclasses RMSNorm (not covered)")
            elif not _bound_to(m._forward_method, kernels.rms_norm_forward):
                problems.append(f"{name}: RMSNorm forward is {m._forward_method!r} (installed after the build?)")
            elif m.variance_size_override is not None:
                problems.append(f"{name}: RMSNorm with var_hidden_size override")
        elif isinstance(m, SiluAndMul):
            kind = "silu_and_mul"
            ok = _bound_to(m._forward_method, kernels.silu_and_mul_forward) or \
                m._forward_method is kernels.silu_and_mul_native
            if type(m) is not SiluAndMul or not ok:
                problems.append(f"{name}: SiluAndMul forward is {m._forward_method!r}")
        elif isinstance(m, RotaryEmbeddingBase):
            kind = "rope"
            if type(m) is not RotaryEmbedding:
                problems.append(f"{name}: {type(m).__name__} (scaled / multimodal RoPE is not covered)")
            elif not _bound_to(m._forward_method, kernels.rope_forward):
                problems.append(f"{name}: RotaryEmbedding forward is {m._forward_method!r}")
            elif not m.is_neox_style or m.rotary_dim != m.head_size:
                problems.append(f"{name}: RoPE neox={m.is_neox_style} rotary_dim={m.rotary_dim} "
                                f"head_size={m.head_size} (needs neox over the full head)")
        elif isinstance(m, ApplyRotaryEmb):
            kind = "apply_rotary_emb(unused)"  # only RotaryEmbedding.forward_static calls it
        elif isinstance(m, Attention):
            kind = "attention"
            problems.extend(_attention_problems(name, m.impl))
        elif isinstance(m, CustomOp) and name in covered:
            kind = f"{type(m).__name__}(adapter)"
        elif isinstance(m, CustomOp):
            kind = type(m).__name__
            problems.append(f"{name}: CustomOp {type(m).__name__} is not covered by a parity provider")
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1
    if problems:
        from unirl_parity_vllm.vllm_side.kernels import ParityKernelError

        raise ParityKernelError(f"unirl-parity-vllm: the built model {type(model).__name__} cannot run exactly "
                                f"({len(problems)} problem(s)):\n  - " + "\n  - ".join(problems))
    return {"model": type(model).__name__, "modules": counts,
            "dtype": str(vllm_config.model_config.dtype),
            "compilation_mode": getattr(mode, "name", str(mode))}
