"""bf16 compute parity on the embedded path (issue 31, item 1, torch engine + torch actor).

The actor keeps fp32 master weights (core's ``ActorSkeleton._prepare_model``) and its optimizer in
fp32; under ``exact_context`` the provider casts every weight to bf16 on use and the token embedding
hands the decoder bf16 activations, so the actor computes on the bytes a bf16 engine serves. Why these
tests: the cast is the whole claim, so they check it against a real bf16 copy of the model (the
engine's precision) bit for bit, that gradients still reach the fp32 master weights, that an fp32 run
casts nothing, and (slow) the recipe end to end with 0 mismatches in both phases.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from unirl.api import Qwen3Adapter, RunConfig, Sample, load_config, load_kernel
from unirl.models.qwen3_moe import Qwen3MoeAdapter
from unirl.packing import pack
from unirl_parity_vllm import plugin
from unirl_parity_vllm.moe import Qwen3MoeParityProvider
from unirl_parity_vllm.providers import COMPUTE_DTYPE, Qwen3ParityProvider

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "parity-tiny-bf16-embedded.yaml"
MOE_RECIPE = ROOT / "recipes" / "parity-moe-tiny-bf16-embedded.yaml"
#: (adapter, provider): the dense family and the MoE one, whose router and expert tensors are cast too
FAMILIES = [pytest.param(Qwen3Adapter, Qwen3ParityProvider, id="dense"),
            pytest.param(Qwen3MoeAdapter, Qwen3MoeParityProvider, id="moe")]
VOCAB = 64


def tiny_model(seed: int = 0, adapter=None):
    import transformers

    adapter = adapter or Qwen3Adapter()
    cfg = adapter.hf_config(_config("float32"), vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    return getattr(transformers, adapter.model_class)(cfg).eval()


def samples(n: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(1, 20, (1,), generator=g))
        r = int(torch.randint(1, 50, (1,), generator=g))
        out.append(Sample(id=f"p{i}/0", prompt_ids=torch.randint(2, VOCAB, (p,), generator=g).tolist(),
                          response_ids=torch.randint(2, VOCAB, (r,), generator=g).tolist()))
    return out


def logprobs(model, batch):
    from unirl.actor.skeleton import forward_logprobs

    with torch.no_grad():
        return forward_logprobs(model, pack(batch))[0]


def _config(dtype: str) -> RunConfig:
    return RunConfig.model_validate({"model": {"dtype": dtype}, "plugins": {"parity": {"enabled": True}}})


@pytest.mark.parametrize(("adapter", "provider"), FAMILIES)
def test_fp32_master_weights_under_bf16_context_equal_a_bf16_copy_bit_for_bit(adapter, provider):
    master = tiny_model(adapter=adapter())  # fp32, as the actor holds it
    served = copy.deepcopy(master).to(torch.bfloat16)  # what a bf16 engine serves
    batch = samples(9)
    prov = provider(config=_config("bfloat16"))
    with prov.exact_context("replay"):
        assert COMPUTE_DTYPE.get() is torch.bfloat16
        replay = logprobs(master, batch)
        engine = logprobs(served, batch)
    assert COMPUTE_DTYPE.get() is None
    assert replay.dtype == torch.float32 and torch.equal(replay, engine)
    # and it is bf16 compute, not the fp32 model: the fp32 replay differs from the bf16 one
    with provider(config=_config("float32")).exact_context("replay"):
        fp32 = logprobs(master, batch)
    assert (fp32 != replay).float().mean() > 0.5, "the bf16 replay must not be the fp32 one"


@pytest.mark.parametrize(("adapter", "provider"), FAMILIES)
def test_gradients_reach_the_fp32_master_weights(adapter, provider):
    from unirl.actor.skeleton import forward_logprobs

    master = tiny_model(adapter=adapter()).train()
    with provider(config=_config("bfloat16")).exact_context("train"):
        logp = forward_logprobs(master, pack(samples(4)))[0]
        logp.sum().backward()
    grads = {n: p.grad for n, p in master.named_parameters()}
    assert all(p.dtype == torch.float32 for p in master.parameters())  # masters stay fp32
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values()), \
        [n for n, g in grads.items() if g is None]
    assert grads["model.embed_tokens.weight"].abs().sum() > 0


def test_fp32_runs_cast_nothing():
    master = tiny_model()
    batch = samples(5)
    with Qwen3ParityProvider(config=_config("float32")).exact_context("replay"):
        assert COMPUTE_DTYPE.get() is None
        a = logprobs(master, batch)
    with Qwen3ParityProvider(config=_config("float32")).exact_context("replay"):
        b = logprobs(copy.deepcopy(master), batch)
    assert torch.equal(a, b)


def test_the_bf16_embedded_recipe_passes_preflight_without_experimental(monkeypatch):
    """bf16 is verified on the embedded path and on vLLM + FSDP; other pairs (here the torch engine with the
    FSDP actor) stay experimental."""
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    monkeypatch.delenv("UNIRL_PARITY_DIR", raising=False)
    c = load_config(str(RECIPE), [])
    assert c.model.dtype == "bfloat16" and not c.plugins["parity"].get("experimental")
    assert plugin.unirl_preflight(c, Qwen3Adapter(), load_kernel()) == []
    fsdp = load_config(str(RECIPE), ["actor.name=fsdp", "plugins.parity.topology.actor=fsdp",
                                     "plugins.parity.topology.actor_ranks=2"])
    out = plugin.unirl_preflight(fsdp, Qwen3Adapter(), load_kernel())
    assert [v.field for v in out] == ["model.dtype"] and "experimental" in out[0].message, [str(v) for v in out]
    assert ("verified on (rollout.engine torch, actor.name torch), (rollout.engine vllm, actor.name fsdp) only"
            in out[0].message)


@pytest.mark.slow
@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
@pytest.mark.parametrize("recipe", [RECIPE, MOE_RECIPE], ids=["dense", "moe"])
def test_bf16_embedded_recipe_is_bitwise_in_both_phases(tmp_path, monkeypatch, recipe):
    """``recipes/parity-tiny-bf16-embedded.yaml`` and ``parity-moe-tiny-bf16-embedded.yaml`` as written: a
    bf16 engine, bf16 actor compute on fp32 master weights, 0 mismatches at ``initial_checkpoint`` and
    ``post_update_reload`` (and for the MoE, no token routed differently)."""
    from unirl.api import load_kernel, train
    from unirl.engine.torch_engine import TorchEngine

    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    monkeypatch.delenv("UNIRL_PARITY_DIR", raising=False)
    engines = []
    init = TorchEngine.__init__

    def capture(self, *a, **kw):
        init(self, *a, **kw)
        engines.append(self)

    monkeypatch.setattr(TorchEngine, "__init__", capture)
    config = load_config(str(recipe), [f"run.output_dir={tmp_path}", "trainer.progress=false", "trainer.plot=false"])
    result = train(config, load_kernel())
    assert result.steps_done == 3
    assert {p.dtype for p in engines[0].model.parameters()} == {torch.bfloat16}  # the engine serves bf16
    doc = json.loads((config.run_dir / "parity" / "artifact.json").read_text())
    init_, post = doc["phases"]["initial_checkpoint"], doc["phases"]["post_update_reload"]
    print(f"\n[{config.run.name}] initial_checkpoint {init_['tokens']} tokens, {init_['mismatches']} mismatches; "
          f"post_update_reload {post['tokens']} tokens, {post['mismatches']} mismatches")
    assert init_["tokens"] >= 2048 and init_["mismatches"] == 0 and init_["max_abs_diff"] == 0.0
    assert post["tokens"] >= 2048 and post["mismatches"] == 0 and post["max_optimizer_steps_before"] == 2
    assert doc["verdict"] == "pass" and doc["skipped_updates"] == 0
    assert doc["run"]["compute_dtype"] == "bfloat16" and doc["run"]["master_dtype"] == "float32"
    assert doc["profile"]["dtype"] == "bfloat16"
    for phase in (init_, post):  # the MoE: every token took the same experts on both sides
        assert "routing" not in phase or (phase["routing"]["mismatch_tokens"] == 0
                                          and phase["routing"]["missing"] == 0), phase["routing"]
    assert ("routing" in init_) == (config.model.adapter == "qwen3_moe")
