"""The tiny Qwen3-MoE on the embedded path, parity on.

* ``recipes/parity-moe-tiny-embedded.yaml`` as written (GRPO, the gate before every backward): zero
  log-prob mismatches over >= 2,048 tokens at ``initial_checkpoint`` and at ``post_update_reload``;
* the embedded engine's KV-cache decode routes every sampled token through the same top-k expert set
  as the actor's packed replay (2,048 tokens), recorded on both sides by a forward hook on
  transformers' router modules (the parity forward keeps the router a module call); and with parity off the engine's default kernels against
  the default replay are reported (routing may differ there; the number is printed, not hidden).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from unirl.config import load_config
from unirl.kernel import load_kernel
from unirl.trainer.loop import train

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "parity-moe-tiny-embedded.yaml"
N_PROMPTS, N_NEW = 32, 64


@pytest.mark.slow
def test_embedded_moe_grpo_is_bitwise_on_policy(tmp_path, monkeypatch):
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    monkeypatch.delenv("UNIRL_PARITY_DIR", raising=False)
    config = load_config(str(RECIPE), [f"run.output_dir={tmp_path}", "trainer.progress=false", "trainer.plot=false",
                                       "trainer.steps=2"])
    assert config.model.adapter == "qwen3_moe"
    result = train(config, load_kernel())
    assert result.steps_done == 2
    doc = json.loads((config.run_dir / "parity" / "artifact.json").read_text())
    init, post = doc["phases"]["initial_checkpoint"], doc["phases"]["post_update_reload"]
    print(f"\n[moe-embedded] initial {init['tokens']} tokens {init['mismatches']} mismatches; "
          f"post-update {post['tokens']} tokens {post['mismatches']} mismatches")
    assert init["tokens"] >= 2048 and init["mismatches"] == 0 and init["max_abs_diff"] == 0.0
    assert post["tokens"] >= 2048 and post["mismatches"] == 0 and post["max_abs_diff"] == 0.0
    assert post["max_optimizer_steps_before"] == 1 and doc["verdict"] == "pass"


def _engine_and_replay(tmp_path):
    from unirl.api import RunConfig
    from unirl.engine.torch_engine import TorchEngine
    from unirl.models.qwen3_moe import Qwen3MoeAdapter

    config = RunConfig.model_validate({"run": {"output_dir": str(tmp_path)}, "model": {"adapter": "qwen3_moe"},
                                       "rollout": {"engine": "torch",
                                                   "options": {"fast_path": False, "batch_size": N_PROMPTS}}})
    adapter = Qwen3MoeAdapter()
    model = adapter.build_model(config)
    return TorchEngine(config=config, adapter=adapter, model=model), model.eval(), config


def _prompts(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(N_PROMPTS)]


@contextlib.contextmanager
def _routers(model):
    """Record every router call's top-k ids (``Qwen3MoeTopKRouter`` output 2), parity on or off:
    the parity forward keeps the router a module call, so the same hook sees both."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from unirl_parity_vllm.moe import RoutingRecorder

    rec = RoutingRecorder()
    handles = [m.register_forward_hook(lambda mod, _a, out: rec.add(mod, out[2]))
               for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]
    try:
        yield rec
    finally:
        for h in handles:
            h.remove()


def _routings(tmp_path, exact: bool):
    """Engine routing of each sampled token and the packed replay's, both ``layer -> [N, k]``."""
    from unirl.contracts import SamplingParams
    from unirl.samples import Sample, expand
    from unirl_parity_vllm import moe

    engine, model, config = _engine_and_replay(tmp_path)
    provider = moe.Qwen3MoeParityProvider(config=config)
    ctx = (lambda: provider.exact_context("rollout")) if exact else contextlib.nullcontext
    samples = expand([Sample(id=f"q{i}", prompt_ids=p) for i, p in enumerate(_prompts(1))], 1, tag="moe",
                     base_seed=5)
    sampling = SamplingParams(max_new_tokens=N_NEW, temperature=1.0, top_p=1.0, top_k=0, ignore_eos=True)
    with ctx(), _routers(engine.model) as rec:
        engine.generate(samples, sampling)
    # the engine's layout: one chunk, rows sorted by (context length, index), left-padded prefill
    # [B, P], then N-1 decode steps of [B, 1] (ignore_eos + one budget: no row leaves early)
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i].prompt_ids), i))
    P = max(len(s.prompt_ids) for s in samples)
    eng = {}
    for layer, rows in rec.by_layer().items():
        B = len(samples)
        assert rows.shape[0] == B * P + (N_NEW - 1) * B, rows.shape
        pre = rows[:B * P].reshape(B, P, -1)[:, -1]
        dec = rows[B * P:].reshape(N_NEW - 1, B, -1)
        per = {order[r]: torch.cat([pre[r][None], dec[:, r]]) for r in range(B)}
        eng[layer] = torch.cat([per[i] for i in range(B)])
    # the actor's replay: all sequences packed in one row, the row at each sampled token's input position
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    ids = torch.tensor([[t for s in seqs for t in s]])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    at, off = [], 0
    for s, seq in zip(samples, seqs, strict=True):
        at += [off + j - 1 for j in range(len(s.prompt_ids), len(seq))]
        off += len(seq)
    with ctx(), torch.no_grad(), _routers(model) as rep:
        model(input_ids=ids, position_ids=pos, use_cache=False)
    replay = {layer: r[torch.tensor(at)] for layer, r in rep.by_layer().items()}
    return moe.routing_stats(eng, replay, model.config.num_experts)


@pytest.mark.slow
def test_engine_decode_routes_like_the_packed_replay(tmp_path):
    on = _routings(tmp_path / "on", exact=True)
    print(f"\n[moe-embedded] routing, parity on: {on['mismatch_tokens']}/{on['tokens']} tokens differ; "
          f"expert load {on['expert_load']}")
    assert on["tokens"] == N_PROMPTS * N_NEW and on["mismatch_tokens"] == 0
    off = _routings(tmp_path / "off", exact=False)  # default kernels: reported honestly, may be > 0
    print(f"[moe-embedded] routing, parity off: {off['mismatch_tokens']}/{off['tokens']} tokens differ "
          f"({off['mismatch_fraction']:.4f})")
    assert off["tokens"] == N_PROMPTS * N_NEW
