"""A bitwise-parity provider for the example Llama family, built from ``unirl_parity_vllm.ops``.

This module is imported only when parity is on (``UNIRL_PARITY_ENABLE=1`` and the ``example-llama``
adapter selected): the plugin registers it as a lazy ``"module:Class"`` string, so the adapter itself
works without ``unirl-parity-vllm`` installed (``pip install unirl-example-adapter[parity]`` adds it).

Llama differs from Qwen3 in two places the reference ops care about: no per-head q/k norm, and
optional biases on the attention and MLP projections. Everything else (RMSNorm formula, neox RoPE,
silu MLP, GQA) is the same, so it reuses ``unirl_parity_vllm.providers``' decoder forwards:
``torch.nn.Linear``, ``LlamaRMSNorm``, ``LlamaMLP`` and ``LlamaAttention`` forwards replaced, as one
all-or-nothing, reference-counted :class:`~unirl_parity_vllm.providers.PatchSet`.

Engines: the embedded torch engine (it runs generation inside ``exact_context("rollout")``). vLLM has
no Llama installer here, so ``install_engine("vllm")`` refuses, and the plugin's preflight says so
before anything starts.
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
    embedded torch engine only."""

    patch_set: PatchSet = _LLAMA

    def install_engine(self, engine: str) -> None:
        if engine != "torch":
            raise ParityInstallError(f"{NAME} parity: no engine-side install for engine {engine!r} (torch only)")
        super().install_engine(engine)


def installed() -> bool:
    """Whether the Llama reference ops are installed right now (tests)."""
    return _LLAMA.installed
