"""The ``qwen3_moe`` model adapter: registered like any built-in, builds a tiny Qwen3-MoE that vLLM's
CPU backend can serve (head_dim 32, 8 experts, top-2), deterministic for a seed, and splits its fused
expert tensors into exactly the per-expert checkpoint tensors ``save_pretrained`` writes (the oracle),
so a weight sync to an HF-format engine is complete and shape-checked against its start-up checkpoint."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from unirl.config import RunConfig
from unirl.kernel import load_kernel
from unirl.models.tokenizer import build_demo_tokenizer
from unirl.weights import WeightSpec, stage_all


def _adapter():
    kernel = load_kernel()
    assert "qwen3_moe" in kernel.names("model_adapters")
    return kernel.build("model_adapters", "qwen3_moe")


def test_tiny_moe_builds_deterministically_and_servable():
    adapter = _adapter()
    config = RunConfig.model_validate({"model": {"adapter": "qwen3_moe"}})
    tok = build_demo_tokenizer()
    hf = adapter.hf_config(config, tok)
    assert hf.model_type == "qwen3_moe" and hf.head_dim == 32 and hf.num_experts == 8
    assert hf.num_experts_per_tok == 2 and hf.vocab_size == len(tok) and hf.mlp_only_layers == []
    a, b = adapter.build_model(config, tok), adapter.build_model(config, tok)
    assert adapter.parity_adapter == "qwen3_moe"
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert a.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 2 * hf.moe_intermediate_size, hf.hidden_size)
    out = a(torch.tensor([[1, 5, 9, 12]]), output_router_logits=True)
    assert out.logits.shape == (1, 4, len(tok)) and len(out.router_logits) == 2
    assert out.router_logits[0].shape == (4, 8)


def test_engine_weights_split_equals_save_pretrained(tmp_path):
    adapter = _adapter()
    config = RunConfig.model_validate({"model": {"adapter": "qwen3_moe"}})
    model = adapter.build_model(config, build_demo_tokenizer())
    model.save_pretrained(str(tmp_path))
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    state = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}  # tied head
    sent = [p for n, t in state.items() for p in adapter.engine_weights(n, t, "vllm")]
    assert sorted(n for n, _ in sent) == sorted(on_disk)
    for name, tensor in sent:
        assert torch.equal(tensor, on_disk[name]), name
    # the embedded engine holds the same modules: no split
    assert adapter.engine_weights("model.layers.0.mlp.experts.gate_up_proj",
                                  state["model.layers.0.mlp.experts.gate_up_proj"], "torch")[0][0] \
        == "model.layers.0.mlp.experts.gate_up_proj"
    # staged through core's checks against the engine's checkpoint spec: complete, every shape right
    spec = WeightSpec.from_checkpoint(tmp_path, "float32")
    staged = stage_all(spec, state.items(), expand=lambda n, t: adapter.engine_weights(n, t, "vllm"))
    assert len(staged.finish()) == len(on_disk)


def _loss(model, samples, coef: float):
    from unirl.actor.skeleton import micro_batch_loss
    from unirl.algorithms.losses import LossSettings, ppo_clip

    config = RunConfig.model_validate({"model": {"adapter": "qwen3_moe"},
                                       "algorithm": {"router_aux_loss_coef": coef}})
    batch = {"advantages": [torch.ones(len(s.response_ids)) for s in samples],
             "old_logprobs": [torch.zeros(len(s.response_ids)) for s in samples]}
    n = sum(len(s.response_ids) for s in samples)
    return micro_batch_loss(model, samples, batch, config=config, loss_fn=ppo_clip, total_tokens=2.0 * n,
                            total_seqs=len(samples),
                            settings=LossSettings.from_algorithm(
                                config.algorithm, norm_len=config.rollout.max_new_tokens))


def _switch_loss(router_logits, num_experts: int, top_k: int) -> torch.Tensor:
    """Switch Transformer load balancing, by hand in float64: E * sum_e f_e * P_e over all layers' rows."""
    probs = torch.cat([torch.softmax(x.double(), -1) for x in router_logits])
    top = probs.topk(top_k, -1).indices
    f = torch.zeros(num_experts, dtype=torch.float64).index_add_(0, top.reshape(-1),
                                                                 torch.ones(top.numel(), dtype=torch.float64))
    return num_experts * (f / probs.shape[0] * probs.mean(0)).sum()


def test_router_aux_loss_is_an_option_of_the_loss_off_by_default():
    from unirl.actor.skeleton import ActorInputError
    from unirl.packing import pack
    from unirl.samples import Sample

    adapter = _adapter()
    config = RunConfig.model_validate({"model": {"adapter": "qwen3_moe"}})
    assert config.algorithm.router_aux_loss_coef == 0.0
    model = adapter.build_model(config, build_demo_tokenizer())
    samples = [Sample(id=f"s{i}", prompt_ids=[1, 5 + i, 9], response_ids=[7, 8 + i, 2], loss_mask=[1, 1, 1])
               for i in range(3)]
    off, m_off, _ = _loss(model, samples, 0.0)
    on, m_on, _ = _loss(model, samples, 0.5)
    assert "router_aux_loss" not in m_off
    packed = pack(samples)
    with torch.no_grad():
        out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, output_router_logits=True)
    expected = _switch_loss(out.router_logits, 8, 2) * 0.5  # this micro-batch holds half the step's tokens
    assert abs(float(m_on["router_aux_loss"]) - float(expected)) < 1e-5
    assert abs(float(on.detach() - off.detach()) - 0.5 * float(expected)) < 1e-5
    on.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    # a dense model has no router: a clear error, not a silent no-op
    from unirl.models.qwen3 import Qwen3Adapter

    dense = Qwen3Adapter().build_model(RunConfig(), build_demo_tokenizer())
    with pytest.raises(ActorInputError, match="router_aux_loss_coef"):
        _loss(dense, samples, 0.5)
