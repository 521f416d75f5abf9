"""The qwen3 provider: off without the flag, patches removed on exit, packing- and decode-invariant."""

from __future__ import annotations

import pytest
import torch

from unirl.api import Qwen3Adapter, RunConfig, Sample, default_runtime, load_kernel
from unirl.packing import pack
from unirl_parity_vllm import providers
from unirl_parity_vllm.providers import ParityInstallError, Qwen3ParityProvider

VOCAB = 64


def config() -> RunConfig:
    return RunConfig.model_validate({"plugins": {"parity": {"enabled": True}}})


def tiny_model(seed: int = 0):
    from transformers import Qwen3ForCausalLM

    cfg = Qwen3Adapter().hf_config(config(), vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).eval()


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


def originals():
    from transformers.models.qwen3 import modeling_qwen3 as m

    return {"linear": torch.nn.Linear.forward, "norm": m.Qwen3RMSNorm.forward, "mlp": m.Qwen3MLP.forward,
            "attn": m.Qwen3Attention.forward}


def test_flag_absent_no_provider_nothing_installed_outputs_unchanged(monkeypatch):
    monkeypatch.delenv("UNIRL_PARITY_ENABLE", raising=False)
    before = originals()
    model, batch = tiny_model(), samples(4)
    plain = logprobs(model, batch)
    rt = default_runtime(config(), adapter=Qwen3Adapter())
    assert rt.parity is None  # the provider is registered but not enabled
    with rt.exact("replay"):
        assert originals() == before and not providers.installed()
        again = logprobs(model, batch)
    assert torch.equal(plain, again)
    from unirl_parity_vllm import plugin

    assert plugin.unirl_worker_env(config()) == {}
    # preflight is the one hook with something to say: the recipe opts in, so without the flag it would
    # train with no gate (issue 31, "Opt-in rules"); a recipe that does not opt in gets nothing
    assert [v.field for v in plugin.unirl_preflight(config(), Qwen3Adapter(), load_kernel())] == [
        "plugins.parity.enabled, env UNIRL_PARITY_ENABLE"]
    assert plugin.unirl_preflight(RunConfig(), Qwen3Adapter(), load_kernel()) == []


def test_flag_on_enables_the_provider(monkeypatch):
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    rt = default_runtime(config(), adapter=Qwen3Adapter())
    assert isinstance(rt.parity, Qwen3ParityProvider)
    from unirl_parity_vllm import plugin

    env = plugin.unirl_worker_env(config())
    assert env["UNIRL_PARITY_ENABLE"] == "1" and "UNIRL_PARITY_DIR" in env


def test_the_engine_reads_the_providers_key_block(monkeypatch):
    """Core knows no parity constant: the provider declares its attention's key chunk, the embedded
    engine allocates its cache in whole blocks of it (and of 1 without parity)."""
    from unirl.engine.torch_engine import TorchEngine
    from unirl_parity_vllm import ops

    assert Qwen3ParityProvider.key_block == ops.KEY_CHUNK
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    cfg = config()
    rt = default_runtime(cfg, adapter=Qwen3Adapter())
    tok = Qwen3Adapter().build_tokenizer(cfg)
    engine = TorchEngine(config=cfg, adapter=Qwen3Adapter(), tokenizer=tok, runtime=rt)
    try:
        assert engine.module_attention and engine.key_block == ops.KEY_CHUNK
    finally:
        engine.close()
    monkeypatch.delenv("UNIRL_PARITY_ENABLE")
    plain = TorchEngine(config=cfg, adapter=Qwen3Adapter(), tokenizer=tok,
                        runtime=default_runtime(cfg, adapter=Qwen3Adapter()))
    try:
        assert not plain.module_attention and plain.key_block == 1
    finally:
        plain.close()


def test_exact_context_installs_and_removes_its_patches():
    before = originals()
    prov = Qwen3ParityProvider(config=config())
    with prov.exact_context("replay"):
        inside = originals()
        assert all(inside[k] is not before[k] for k in before) and providers.installed()
        with prov.exact_context("train"):  # nested: still installed, removed once at the end
            pass
        assert providers.installed()
    assert originals() == before and not providers.installed()
    with pytest.raises(RuntimeError, match="boom"), prov.exact_context("train"):
        raise RuntimeError("boom")
    assert originals() == before and not providers.installed()


def test_a_moved_symbol_fails_closed(monkeypatch):
    before = originals()

    class Broken(providers.Qwen3Patches):
        def patches(self):
            good = super().patches()
            return good[:2] + [(torch.nn.Linear, "no_such_symbol", None)]

    with pytest.raises(ParityInstallError, match="no_such_symbol"):
        Broken().install()
    assert originals() == before  # nothing half-installed


def test_patched_model_is_correct_and_packing_invariant():
    model, batch = tiny_model(), samples(9)
    plain = logprobs(model, batch)
    prov = Qwen3ParityProvider(config=config())
    with prov.exact_context("replay"):
        packed = logprobs(model, batch)
        alone = torch.cat([logprobs(model, [s]) for s in batch])
        reordered = logprobs(model, batch[::-1])
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-5)  # the same model, other kernels
    assert torch.equal(packed, alone)  # packing does not change a bit
    per = packed.split([len(s.response_ids) for s in batch])
    rper = reordered.split([len(s.response_ids) for s in batch[::-1]])
    assert all(torch.equal(a, b) for a, b in zip(per, rper[::-1], strict=True))


def test_embedded_engine_decode_equals_packed_replay(monkeypatch):
    """The torch engine's KV-cache decode (left-padded batch) equals the actor's packed replay."""
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    from unirl.api import SamplingParams, build_engine

    cfg = RunConfig.model_validate({"plugins": {"parity": {"enabled": True}}, "rollout": {"max_new_tokens": 40}})
    rt = default_runtime(cfg, adapter=Qwen3Adapter())
    model = tiny_model()
    hf_cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"options": {"fast_path": False}})})
    for run_cfg, fast in ((cfg, True), (hf_cfg, False)):
        engine = build_engine(run_cfg, adapter=Qwen3Adapter(), model=model, runtime=rt, tokenizer=_Tok())
        assert engine.fast is fast  # parity keeps the fast decoder; its attention is the provider's
        batch = [Sample(id=f"p{i}/0", prompt_ids=s.prompt_ids, seed=i) for i, s in enumerate(samples(12, seed=3))]
        engine.generate(batch, SamplingParams(max_new_tokens=40, temperature=1.0))
        assert not providers.installed()
        with rt.exact("replay"):
            replay = logprobs(model, batch)
        rollout = torch.tensor([x for s in batch for x in s.rollout_logprobs])
        assert rollout.numel() > 200
        assert torch.equal(replay, rollout), f"fast={fast}: {int((replay != rollout).sum())} of {rollout.numel()} differ"
        if fast:
            fast_tokens = [s.response_ids for s in batch]
        else:  # both decoders draw the same tokens under parity (same logits bit for bit)
            assert [s.response_ids for s in batch] == fast_tokens


class _Tok:
    eos_token_id = 1
    pad_token_id = 0
    all_special_ids = [0, 1]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)

    def __len__(self):
        return VOCAB
