"""``actor.lora.sync: adapter``: the LoRA adapter alone, served by vLLM's LoRA support (docs/lora.md).

The oracles are independent of UniRL's sync: HF transformers greedy-decoding peft's
``merge_and_unload()`` of the actor's adapter, and, in the training run, the actor's own fp32 replay
of the tokens vLLM sampled (``rollout_replay_max_diff``), which only stays small if vLLM serves the
adapter of the version the trainer committed.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ["1 + 2 =", "3 + 4 =", "7 + 1 ="]

pytestmark = [pytest.mark.vllm]


def _config(tmp: Path, model_dir: Path, **lora):
    from unirl.api import RunConfig

    return RunConfig.model_validate({
        "run": {"output_dir": str(tmp), "seed": 0},
        "model": {"path": str(model_dir)},
        "actor": {"lora": {"r": 8, "sync": "adapter", **lora}},
        "rollout": {"engine": "vllm", "options": {"kv_cache_gb": 0.25, "max_model_len": 256}},
        "weight_sync": {"name": "vllm"},
    })


def _greedy_vllm(engine, tok) -> list[list[int]]:
    from unirl.api import Sample, SamplingParams

    samples = [Sample(id=f"p{i}", prompt_ids=tok(p).input_ids) for i, p in enumerate(PROMPTS)]
    engine.generate(samples, SamplingParams(max_new_tokens=8, temperature=0.0, top_p=1.0, top_k=0))
    return [s.response_ids for s in samples]


def _greedy_hf(model, tok) -> list[list[int]]:
    import torch

    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([tok(p).input_ids])
            g = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
            out.append(g[0, ids.shape[1]:].tolist())
    return out


@pytest.mark.slow
def test_adapter_sync_serves_what_merge_and_unload_decodes(require_vllm, tiny_model_dir, tmp_path):
    """An adapter-only sync: receipts match the sender's fingerprint and vLLM's greedy tokens are HF's
    on peft's merge of the same adapter (and not the base's)."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from unirl.actor.torch_actor import TorchActor
    from unirl.api import Qwen3Adapter, build_engine, default_runtime
    from unirl_vllm.sync import VLLMWeightSync

    config = _config(tmp_path, tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    base = Qwen3ForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    actor = TorchActor(config=config, runtime=default_runtime(config), adapter=Qwen3Adapter(),
                       model=copy.deepcopy(base))
    with torch.no_grad():  # a trained-looking adapter: peft initialises lora_B to 0 (a no-op)
        g = torch.Generator().manual_seed(1)
        for name, p in actor.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    engine = build_engine(config, adapter=Qwen3Adapter())
    try:
        assert engine.llm_kwargs["enable_lora"] and engine.llm_kwargs["max_lora_rank"] == 8
        before = _greedy_vllm(engine, tok)
        assert before == _greedy_hf(base, tok)  # the base serves before any adapter
        receipts, sent = VLLMWeightSync(config=config).publish(actor, engine, 1)
        assert [r.fingerprint for r in receipts] == [sent] and engine.weight_version == 1
        assert receipts[0].num_tensors == sum(".lora_" in n for n, _ in actor.model.named_parameters())
        served = _greedy_vllm(engine, tok)
        merged = copy.deepcopy(actor.model).merge_and_unload().eval()
        assert served == _greedy_hf(merged, tok)
        assert served != before, "the adapter changed nothing: the oracle would not see a broken sync"
        # a second version replaces the first (same tokens as the base once lora_B is zero again)
        with torch.no_grad():
            for name, p in actor.model.named_parameters():
                if "lora_B" in name:
                    p.zero_()
        receipts2, sent2 = VLLMWeightSync(config=config).publish(actor, engine, 2)
        assert sent2 != sent and [r.fingerprint for r in receipts2] == [sent2]
        assert _greedy_vllm(engine, tok) == before
    finally:
        engine.close()


@pytest.mark.slow
def test_train_with_adapter_sync_serves_each_committed_adapter(require_vllm, tmp_path):
    """Two GRPO steps of the vLLM demo with ``actor.lora.sync: adapter``: every version is an adapter
    (distinct fingerprints), and vLLM's sampled log-probs match the actor's replay at every step."""
    from unirl.api import load_config, load_kernel, train

    config = load_config(ROOT / "recipes" / "arith-tiny-vllm.yaml",
                         [f"run.output_dir={tmp_path}", "trainer.progress=false", "trainer.plot=false",
                          "trainer.steps=2", "trainer.eval_every=0", "trainer.eval_k=1", "sft.steps=0",
                          "actor.lr=1e-2", "actor.lora={r: 8, sync: adapter}"])
    result = train(config, load_kernel())
    steps = [h for h in result.history if h["step"] > 0]
    assert len(steps) == 2 and all(h["grad_norm"] > 0 for h in steps)
    # vLLM with the adapter samples what the actor (base + adapter) assigns: it serves the committed adapter
    assert max(h["rollout_replay_max_diff"] for h in steps) < 1e-4
    log = (result.run_dir / "weights.log").read_text()
    prints = re.findall(r"version (\d+): 1 receipt\(s\) .*fingerprint (\w+)", log)
    assert len(prints) >= 3, log  # the initial version and one per update
    assert len({p for _, p in prints}) == len(prints), f"an update did not change the adapter vLLM got:\n{log}"


def test_preflight_refuses_adapter_sync_on_vllm_tp2_and_the_embedded_engine(tmp_path, require_vllm):
    from unirl.api import RunConfig, load_kernel
    from unirl.preflight import preflight

    kernel = load_kernel()
    for rollout in ({"engine": "vllm", "options": {"tensor_parallel_size": 2}}, {"engine": "torch"}):
        sync = "vllm" if rollout["engine"] == "vllm" else "inprocess"
        config = RunConfig.model_validate({"run": {"output_dir": str(tmp_path)}, "actor": {"lora": {"sync": "adapter"}},
                                           "rollout": rollout, "weight_sync": {"name": sync}})
        found = [v for v in preflight(config, kernel) if v.field == "actor.lora.sync"]
        assert found and "actor.lora.sync: merged" in str(found[0]), rollout
        config = RunConfig.model_validate({"run": {"output_dir": str(tmp_path)}, "actor": {"lora": {"sync": "merged"}},
                                           "rollout": rollout, "weight_sync": {"name": sync}})
        assert not [v for v in preflight(config, kernel) if v.field == "actor.lora.sync"]
