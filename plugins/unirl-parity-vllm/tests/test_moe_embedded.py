"""The tiny Qwen3-MoE on the embedded path, parity on.

* ``recipes/parity-moe-tiny-embedded.yaml`` as written (GRPO, the gate before every backward): zero
  log-prob mismatches over >= 2,048 tokens at ``initial_checkpoint`` and at ``post_update_reload``;
  and the routing diagnostics of every step in the artifact and the step metrics: zero top-k set
  mismatches, every loss token covered, expert load summing to one per layer;
* the embedded engine's KV-cache decode routes every sampled token through the same top-k expert set
  as the actor's packed replay, measured the way a run measures it (the engine files each row under
  its token-prefix hash, :func:`routing.attach`, the gate's :func:`routing.compare`), with stop ids
  ending rows early so finished rows leave the batch; a replay with a perturbed router shows
  mismatches (the metric can fail);
* with parity off the engine's default kernels against the default replay are reported, recorded by
  a forward hook on transformers' router modules (routing may differ there; printed, not hidden).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from unirl.api import build_engine, default_runtime, load_config, load_kernel, train

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "parity-moe-tiny-embedded.yaml"
N_PROMPTS, N_NEW = 32, 64


@pytest.mark.slow
@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
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
    for name, phase in (("initial", init), ("post-update", post)):
        r = phase["routing"]
        print(f"[moe-embedded] {name} routing: {r['mismatch_tokens']}/{r['tokens']} top-k sets differ, "
              f"{r['missing']} without an engine record; max load vs uniform {r['max_load_vs_uniform']}")
        assert r["tokens"] == phase["tokens"] and r["mismatch_tokens"] == 0 and r["missing"] == 0
        assert sorted(r["expert_load"]) == ["0", "1"]
        assert all(len(v) == 8 and abs(sum(v) - 1) < 1e-5 for v in r["expert_load"].values())
    steps = [m for m in result.history if "parity_initial_tokens" in m]  # (history[0] is the first eval)
    assert len(steps) == 2
    for m in steps:  # every step's metrics
        assert m["parity_routing_tokens"] > 0 and m["parity_routing_mismatch_fraction"] == 0.0
        assert m["parity_routing_missing"] == 0 and m["parity_expert_load_max_l0"] >= 1.0


def _engine_and_replay(tmp_path):
    from unirl.api import RunConfig
    from unirl.models.qwen3_moe import Qwen3MoeAdapter

    config = RunConfig.model_validate({"run": {"output_dir": str(tmp_path)}, "model": {"adapter": "qwen3_moe"},
                                       "rollout": {"engine": "torch",
                                                   "options": {"fast_path": False, "batch_size": N_PROMPTS}}})
    adapter = Qwen3MoeAdapter()
    model = adapter.build_model(config)
    engine = build_engine(config, adapter=adapter, model=model, runtime=default_runtime(config))  # options typed
    return engine, model.eval(), config


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


def _routings_on(tmp_path):
    """Parity on, as a run measures it: engine rollout, :func:`routing.attach`, then the gate's
    :func:`routing.compare` on the packed replay (router exact, and router perturbed)."""
    from unirl.api import Sample, SamplingParams, expand
    from unirl.packing import pack
    from unirl_parity_vllm import moe, routing

    engine, model, config = _engine_and_replay(tmp_path)
    provider = moe.Qwen3MoeParityProvider(config=config)
    samples = expand([Sample(id=f"q{i}", prompt_ids=p) for i, p in enumerate(_prompts(1))], 1, tag="moe",
                     base_seed=5)
    # stop ids end rows at different steps: finished rows leave the batch (Cache.batch_select_indices)
    sampling = SamplingParams(max_new_tokens=N_NEW, temperature=1.0, top_p=1.0, top_k=0,
                              stop_token_ids=[3, 4, 5])
    with provider.exact_context("rollout"):
        engine.generate(samples, sampling)
    found = routing.attach(samples, config)

    def gate_view():
        packed = pack(samples)
        with provider.exact_context("train"), torch.no_grad():
            model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
            rec = moe.active()
            return routing.compare(samples, rec.by_layer(), rec.num_experts)

    exact = gate_view()
    gate = model.model.layers[0].mlp.gate.weight
    with torch.no_grad():
        gate.add_(0.05 * torch.randn(gate.shape, generator=torch.Generator().manual_seed(4)))
    return samples, found, exact, gate_view()


def _routings_off(tmp_path):
    """Parity off: engine routing of each sampled token (hook on the routers, mapped by the engine's
    layout) and the packed replay's, both ``layer -> [N, k]``."""
    from unirl.api import Sample, SamplingParams, expand
    from unirl_parity_vllm import moe

    engine, model, config = _engine_and_replay(tmp_path)
    samples = expand([Sample(id=f"q{i}", prompt_ids=p) for i, p in enumerate(_prompts(1))], 1, tag="moe",
                     base_seed=5)
    sampling = SamplingParams(max_new_tokens=N_NEW, temperature=1.0, top_p=1.0, top_k=0, ignore_eos=True)
    with _routers(engine.model) as rec:
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
    with torch.no_grad(), _routers(model) as rep:
        model(input_ids=ids, position_ids=pos, use_cache=False)
    replay = {layer: r[torch.tensor(at)] for layer, r in rep.by_layer().items()}
    return moe.routing_stats(eng, replay, model.config.num_experts)


@pytest.mark.slow
@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
def test_engine_decode_routes_like_the_packed_replay(tmp_path):
    samples, found, on, perturbed = _routings_on(tmp_path / "on")
    n = sum(len(s.response_ids) for s in samples)
    print(f"\n[moe-embedded] routing, parity on: {on['mismatch_tokens']}/{on['tokens']} tokens differ "
          f"(response lengths {min(len(s.response_ids) for s in samples)}-{max(len(s.response_ids) for s in samples)}); "
          f"perturbed router: {perturbed['mismatch_tokens']}/{perturbed['tokens']}")
    assert found == {"found": n, "missing": 0} and len({len(s.response_ids) for s in samples}) > 1
    assert on["tokens"] == n >= 1024 and on["mismatch_tokens"] == 0 and on["missing"] == 0
    assert all(sum(v) == 2 * n for v in on["load"].values())
    assert perturbed["tokens"] == n and perturbed["mismatch_tokens"] > 0
    off = _routings_off(tmp_path / "off")  # default kernels: reported honestly, may be > 0
    print(f"[moe-embedded] routing, parity off: {off['mismatch_tokens']}/{off['tokens']} tokens differ "
          f"({off['mismatch_fraction']:.4f})")
    assert off["tokens"] == N_PROMPTS * N_NEW
