"""A bitwise-parity provider for the example Llama family, built from ``unirl_parity_vllm.ops``.

This module is imported only when parity is on (``UNIRL_PARITY_ENABLE=1`` and the ``example-llama``
adapter selected): the plugin registers it as a lazy ``"module:Class"`` string, so the adapter itself
works without ``unirl-parity-vllm`` installed (``pip install unirl-example-adapter[parity]`` adds it).

Llama differs from Qwen3 in two places the reference ops care about: no per-head q/k norm, and
optional biases on the attention and MLP projections. Everything else (RMSNorm formula, neox RoPE,
silu MLP, GQA) is the same, so it reuses ``unirl_parity_vllm.providers``' decoder forwards:
``torch.nn.Linear``, ``LlamaRMSNorm``, ``LlamaMLP`` and ``LlamaAttention`` forwards replaced, as one
all-or-nothing, reference-counted :class:`~unirl_parity_vllm.providers.PatchSet`.

Engines: the embedded torch engine (it runs generation inside ``exact_context("rollout")``) and vLLM.
On the vLLM side the common providers of ``unirl_parity_vllm.vllm_side`` (linear, RMSNorm, SiLU-mul,
RoPE, paged attention, logits, log-probs) already cover every op of vLLM's Llama; what this family
adds is :func:`vllm_adapter`, discovered through the ``unirl_parity.vllm_adapters`` entry point in
this distribution's ``pyproject.toml``. It wraps ``LlamaForCausalLM.__init__`` so that every model
vLLM builds is validated against the installed providers before it serves a token, and its phase-1
checks pin the vLLM internals it relies on (:func:`_vllm_llama_checks`).
"""

from __future__ import annotations

from typing import Any

from unirl_parity_vllm.providers import (
    ParityInstallError,
    PatchSet,
    Qwen3ParityProvider,
    attention_forward,
    linear_forward,
    mlp_forward,
    rms_norm_forward,
)

NAME = "example-llama"
_attention_forward = attention_forward(NAME, qk_norm=False)  # Llama has no per-head q/k norm


class LlamaPatches(PatchSet):
    name = NAME

    def patches(self) -> list[tuple[Any, str, Any]]:
        import torch
        from transformers.models.llama import modeling_llama as m

        return [
            (torch.nn.Linear, "forward", linear_forward),
            (m.LlamaRMSNorm, "forward", rms_norm_forward),
            (m.LlamaMLP, "forward", mlp_forward),
            (m.LlamaAttention, "forward", _attention_forward),
        ]


_LLAMA = LlamaPatches()


class LlamaParityProvider(Qwen3ParityProvider):
    """``example-llama``: the Qwen3 provider's context and opt-in with the Llama patch set; the
    embedded torch engine and vLLM (whose install also runs :func:`vllm_adapter`, by entry point)."""

    patch_set: PatchSet = _LLAMA

    def install_engine(self, engine: str) -> None:
        if engine not in ("torch", "vllm"):
            raise ParityInstallError(f"{NAME} parity: no engine-side install for engine {engine!r} (torch, vllm)")
        super().install_engine(engine)


def _vllm_llama_checks() -> list[str]:
    """Phase-1 checks of the vLLM Llama internals the common providers rely on (read, never patched)."""
    import inspect

    try:
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.models import llama
    except Exception as exc:  # noqa: BLE001 - a phase-1 violation, not a crash
        return [f"vllm.model_executor.models.llama cannot be imported ({type(exc).__name__}: {exc})"]
    problems = []
    if getattr(llama, "RMSNorm", None) is not RMSNorm:
        problems.append("llama.RMSNorm is not vllm.model_executor.layers.layernorm.RMSNorm (norms would escape)")
    for cls, params in (("LlamaAttention", ("self", "positions", "hidden_states")), ("LlamaMLP", ("self", "x"))):
        owner = getattr(llama, cls, None)
        have = tuple(inspect.signature(owner.forward).parameters) if owner is not None else None
        if have != params:
            problems.append(f"llama.{cls}.forward has parameters {have}, expected {list(params)}")
    return problems


def vllm_adapter():
    """The ``unirl_parity.vllm_adapters`` entry point: validate every vLLM ``LlamaForCausalLM`` build."""
    from unirl_parity_vllm.vllm_side.adapters import model_init_adapter

    return model_init_adapter(NAME, "vllm.model_executor.models.llama", "LlamaForCausalLM",
                              checks=[_vllm_llama_checks],
                              init_params=("self", "vllm_config", "prefix", "layer_type"))


def installed() -> bool:
    """Whether the Llama reference ops are installed right now (tests)."""
    return _LLAMA.installed
