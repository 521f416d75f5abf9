"""Helpers for the vLLM-side parity tests and benchmarks (torch is imported by the callers' need).

* :func:`build_tiny_qwen3` - the tiny random Qwen3 the tests use (hidden 64, 2 layers, head_dim 32,
  tied embeddings, fp32), saved with the demo tokenizer;
* :func:`ops_replay_logprobs` - a teacher-forced **packed** replay of many sequences composed directly
  from :mod:`unirl_parity_vllm.ops` on a transformers ``Qwen3ForCausalLM``'s weights: the trainer-side
  computation the engine's sampled-token log-probs must equal bit for bit;
* :func:`compare` - equality count, max |diff| over all tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from unirl_parity_vllm import ops


def build_tiny_qwen3(out: Path, seed: int = 0) -> Path:
    from transformers import Qwen3ForCausalLM

    from unirl.api import Qwen3Adapter, RunConfig, build_demo_tokenizer

    tok = build_demo_tokenizer()
    config = RunConfig.model_validate({"model": {"build": {"hidden_size": 64, "intermediate_size": 128,
                                                           "num_attention_heads": 2, "num_key_value_heads": 1}}})
    hf = Qwen3Adapter().hf_config(config, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(hf).to(torch.float32)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@torch.no_grad()
def ops_hidden_states(model: Any, seqs: list[list[int]], upto: str | None = None) -> dict[str, torch.Tensor]:
    """The packed teacher-forced forward (all ``seqs`` in one row, causal within each) through ``ops``.

    Returns intermediate tensors by name (``layer{i}.attn_out`` ...), ``final`` (after the last
    norm) and ``logits``, each ``[N, ...]`` in packed order."""
    cfg = model.config
    inner = model.model
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    pos = torch.cat([torch.arange(len(s), dtype=torch.long) for s in seqs])
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor([len(s) for s in seqs]), 0).tolist()))
    n = ids.shape[0]
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    eps = cfg.rms_norm_eps
    theta = cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta
    cos, sin = ops.rope_cos_sin(d, float(theta), cfg.max_position_embeddings)
    scale = d ** -0.5
    out: dict[str, torch.Tensor] = {}
    h = inner.embed_tokens.weight[ids]
    for i, layer in enumerate(inner.layers):
        a, m = layer.self_attn, layer.mlp
        x = ops.rms_norm(h, layer.input_layernorm.weight, eps)
        q = ops.linear(x, a.q_proj.weight, a.q_proj.bias).view(n, hq, d)
        k = ops.linear(x, a.k_proj.weight, a.k_proj.bias).view(n, hkv, d)
        v = ops.linear(x, a.v_proj.weight, a.v_proj.bias).view(n, hkv, d)
        q = ops.rope(pos, ops.rms_norm(q, a.q_norm.weight, eps), cos, sin)
        k = ops.rope(pos, ops.rms_norm(k, a.k_norm.weight, eps), cos, sin)
        out[f"layer{i}.q"], out[f"layer{i}.k"], out[f"layer{i}.v"] = q, k, v
        o = ops.varlen_attention(q, k, v, cu, scale)
        out[f"layer{i}.attn"] = o
        h = h + ops.linear(o.reshape(n, hq * d), a.o_proj.weight)
        out[f"layer{i}.resid_attn"] = h
        x = ops.rms_norm(h, layer.post_attention_layernorm.weight, eps)
        g = ops.linear(x, m.gate_proj.weight)
        u = ops.linear(x, m.up_proj.weight)
        h = h + ops.linear(ops.silu_mul(g, u), m.down_proj.weight)
        out[f"layer{i}.resid_mlp"] = h
    h = ops.rms_norm(h, inner.norm.weight, eps)
    out["final"] = h
    out["logits"] = ops.linear(h, model.lm_head.weight)
    return out


@torch.no_grad()
def ops_replay_logprobs(model: Any, prompts: list[list[int]], responses: list[list[int]]) -> list[torch.Tensor]:
    """fp32 selected-token log-probs of every response token, one packed teacher-forced forward."""
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
    logits = ops_hidden_states(model, seqs)["logits"]
    result, start = [], 0
    for p, r in zip(prompts, responses, strict=True):
        rows = logits[start + len(p) - 1: start + len(p) - 1 + len(r)]
        result.append(ops.selected_logprobs(rows, torch.tensor(r, dtype=torch.long)))
        start += len(p) + len(r)
    return result


def compare(got: list[list[float]] | list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, Any]:
    """``torch.equal`` over all tokens, with the count of bit-equal tokens and the max |diff|."""
    g = torch.cat([torch.as_tensor(x, dtype=torch.float32).reshape(-1) for x in got])
    r = torch.cat([x.reshape(-1).to(torch.float32) for x in ref])
    if g.shape != r.shape:
        return {"equal": False, "tokens": int(r.numel()), "shape_mismatch": [int(g.numel()), int(r.numel())]}
    same = (g == r)
    return {"equal": bool(torch.equal(g, r)), "tokens": int(r.numel()), "bit_equal": int(same.sum()),
            "rate": float(same.float().mean()) if r.numel() else 1.0,
            "max_abs_diff": float((g.double() - r.double()).abs().max()) if r.numel() else 0.0}


def provider_replay_logprobs(model: Any, prompts: list[list[int]], responses: list[list[int]],
                             processing: ops.LogprobProcessing | None = None) -> list[torch.Tensor]:
    """The trainer side through the ``qwen3`` provider: one packed row (``position_ids`` restarting per
    sequence) inside ``exact_context``; fp32 selected-token log-probs, raw or under ``processing``."""
    from unirl_parity_vllm.providers import Qwen3ParityProvider

    seqs = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
    ids = torch.tensor([[t for s in seqs for t in s]])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad(), Qwen3ParityProvider(config=None).exact_context("replay"):
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    out, start = [], 0
    for p, r, seq in zip(prompts, responses, seqs, strict=True):
        rows = logits[start + len(p) - 1: start + len(p) - 1 + len(r)]
        out.append(ops.selected_logprobs(rows, torch.tensor(r, dtype=torch.long), processing))
        start += len(seq)
    return out


def multiprocess_probe(model_dir: str, out_json: str, n_prompts: int = 8, n_new: int = 32,
                       tensor_parallel_size: int = 1) -> dict[str, Any]:
    """Run in a fresh interpreter with ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (the test does): a UniRL vLLM
    engine whose EngineCore / Worker processes load the parity plugin through the entry point; sampled
    log-probs compared with the provider replay here, before and after an in-place weight update (the
    update travels as a tmpfs safetensors file)."""
    import json
    import os

    from transformers import Qwen3ForCausalLM

    from unirl.api import Qwen3Adapter, RunConfig, Sample, SamplingParams, build_engine, expand

    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1" or tensor_parallel_size > 1
    run_dir = Path(out_json).parent / "run"
    config = RunConfig.model_validate({
        "run": {"output_dir": str(run_dir), "seed": 0}, "model": {"path": model_dir},
        "rollout": {"engine": "vllm", "options": {"kv_cache_gb": 0.25, "max_model_len": 256, "ignore_eos": True,
                                                 "tensor_parallel_size": tensor_parallel_size}},
        "weight_sync": {"name": "vllm"},
    })
    engine = build_engine(config, adapter=Qwen3Adapter())
    replay = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 250, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n_prompts)]
    sampling = SamplingParams(max_new_tokens=n_new, temperature=1.0, top_p=1.0, top_k=0)
    result: dict[str, Any] = {"pid": os.getpid(), "host_info": engine.host_info}
    try:
        for phase, version in (("initial_checkpoint", 0), ("post_update_reload", 1)):
            if version:
                gen = torch.Generator().manual_seed(5)
                new = {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in replay.state_dict().items()}
                new["lm_head.weight"] = new["model.embed_tokens.weight"]
                result["receipts"] = [vars(r) for r in engine.load_weights(list(new.items()), version=version)]
                replay.load_state_dict(new, strict=False)
            roots = [Sample(id=f"m{i}", prompt_ids=p) for i, p in enumerate(prompts)]
            samples = engine.generate(expand(roots, 1, tag=phase, base_seed=31), sampling)
            got = [s.rollout_logprobs for s in samples]
            ref = provider_replay_logprobs(replay, [s.prompt_ids for s in samples], [s.response_ids for s in samples])
            result[phase] = compare(got, ref)
            result[phase]["versions"] = sorted({v for s in samples for v in s.versions})
    finally:
        engine.close()
    from unirl_parity_vllm.vllm_side import installer

    result["main_manifest"] = installer.manifest()
    Path(out_json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":  # python -m unirl_parity_vllm.vllm_side.testing MODEL_DIR OUT_JSON
    import sys

    multiprocess_probe(sys.argv[1], sys.argv[2], tensor_parallel_size=int(sys.argv[3]) if len(sys.argv) > 3 else 1)
