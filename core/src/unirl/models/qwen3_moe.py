"""The ``qwen3_moe`` model adapter: transformers' Qwen3-MoE, built tiny from scratch or loaded from a dir.

Why a second family: Mixture-of-Experts is where train-inference mismatch hurts most (a last-bit
difference in a router logit can flip a top-k decision and send a token through other experts), so
the parity profile's seed model is a Qwen3-MoE. The tiny default keeps ``head_dim`` at 32 (vLLM's CPU
attention accepts only 32, 64, 80, ...), 8 experts, top-2, every layer sparse.

Weights: transformers 5 stores each layer's experts fused, ``mlp.experts.gate_up_proj [E, 2I, H]`` and
``mlp.experts.down_proj [E, H, I]``; FSDP shards them like any other parameter and the embedded engine
copies them as they are. :meth:`Qwen3MoeAdapter.engine_weight_names` splits them into the per-expert
checkpoint names (``mlp.experts.{e}.gate_proj.weight`` ...) that vLLM's ``Qwen3MoeForCausalLM.load_weights``
maps into its fused ``w13`` / ``w2`` parameters, so an in-place weight sync reaches every expert.

Router logits for the auxiliary load-balancing loss: :meth:`router_logits` reads the documented
``router_logits`` field of transformers' ``MoeCausalLMOutputWithPast`` (one ``[tokens, experts]``
tensor per sparse layer) when the forward was asked for it (:meth:`forward_kwargs`).

Routers for R3 (``algorithm.routing_replay``, :mod:`unirl.routing`): :meth:`Qwen3MoeAdapter.routers`
declares each sparse layer's ``mlp.gate`` (transformers' ``Qwen3MoeTopKRouter``: ``(logits, weights,
ids)``, softmax then top-k, renormalised when ``norm_topk_prob``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unirl.models.qwen3 import Qwen3Adapter

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.config import RunConfig
    from unirl.routing import RouterSpec

#: about 2.6 M parameters (8 experts x 2 layers): learns the arithmetic format on 2 CPU cores
TINY_QWEN3_MOE: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=384,  # dense MLP size (used only by layers listed in mlp_only_layers)
    moe_intermediate_size=128,  # a multiple of 32: row-invariant elementwise ops (docs/parity.md)
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    router_aux_loss_coef=0.001,
    output_router_logits=False,
)

_FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def _same_family(model: torch.nn.Module, config: RunConfig) -> torch.nn.Module:
    if model.config.model_type != "qwen3_moe":
        raise ValueError(f"model.adapter=qwen3_moe needs a Qwen3-MoE checkpoint; {config.model.path} holds "
                         f"model_type={model.config.model_type!r} (use model.adapter=qwen3)")
    return model


class Qwen3MoeAdapter(Qwen3Adapter):
    name = "qwen3_moe"
    parity_adapter = "qwen3_moe"

    tiny = TINY_QWEN3_MOE
    config_class, model_class = "Qwen3MoeConfig", "Qwen3MoeForCausalLM"
    model_types = ("qwen3_moe",)

    def build_model(self, config: RunConfig, tokenizer: Any = None) -> torch.nn.Module:
        """:meth:`Qwen3Adapter.build_model`, refusing a checkpoint of another family."""
        return _same_family(super().build_model(config, tokenizer), config)

    def build_empty(self, config: RunConfig, tokenizer: Any = None) -> torch.nn.Module:
        """:meth:`Qwen3Adapter.build_empty`, refusing a checkpoint of another family."""
        return _same_family(super().build_empty(config, tokenizer), config)

    def engine_weights(self, name: str, tensor: torch.Tensor, engine: str) -> list[tuple[str, torch.Tensor]]:
        """Fused experts -> per-expert checkpoint tensors for every engine but the embedded one (which
        holds the same transformers modules): ``gate_up_proj [E, 2I, H]`` -> ``experts.{e}.gate_proj.weight``
        ``[I, H]`` + ``experts.{e}.up_proj.weight``; ``down_proj [E, H, I]`` -> ``experts.{e}.down_proj.weight``.
        The names are what ``save_pretrained`` writes, so they match the engine's start-up checkpoint."""
        if engine == "torch" or not name.endswith(_FUSED):
            return super().engine_weights(name, tensor, engine)
        prefix = name.rsplit(".", 1)[0]  # "...mlp.experts"
        out: list[tuple[str, torch.Tensor]] = []
        if name.endswith(".gate_up_proj"):
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out.append((self.engine_weight_name(f"{prefix}.{e}.gate_proj.weight", engine), tensor[e, :half]))
                out.append((self.engine_weight_name(f"{prefix}.{e}.up_proj.weight", engine), tensor[e, half:]))
        else:
            for e in range(tensor.shape[0]):
                out.append((self.engine_weight_name(f"{prefix}.{e}.down_proj.weight", engine), tensor[e]))
        return out

    def routers(self, model: torch.nn.Module) -> list[RouterSpec]:
        """Each sparse layer's router, in layer order (dense ``mlp_only_layers`` have none). ``model``
        may be wrapped (FSDP2 keeps the module classes; a LoRA model is searched through)."""
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        from unirl.routing import RouterSpec

        out = []
        for name, mod in model.named_modules():
            if isinstance(mod, Qwen3MoeTopKRouter):
                layer = int(name.split(".layers.")[1].split(".")[0])
                out.append(RouterSpec(mod, layer, mod.top_k, mod.num_experts, bool(mod.norm_topk_prob)))
        return sorted(out, key=lambda r: r.layer)
