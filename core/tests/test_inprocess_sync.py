"""In-process weight sync: receipts agree with the sender's manifest; a tampered receipt blocks commit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from unirl.actor.torch_actor import TorchActor
from unirl.config import RunConfig
from unirl.contracts import SamplingParams, VersionLedger, fingerprint
from unirl.engine.torch_engine import TorchEngine
from unirl.kernel.errors import OptionsError, SyncRefusedError, WeightSyncError
from unirl.kernel.manager import load_kernel
from unirl.models.qwen3 import Qwen3Adapter
from unirl.samples import Sample
from unirl.sync.inprocess import InProcessSync
from unirl.testing import build_engine, default_runtime


@pytest.fixture(scope="module")
def setup():
    config = RunConfig.model_validate({"actor": {"lr": 1e-2, "micro_batch_size": 8},
                                       "rollout": {"max_new_tokens": 6}})
    adapter = Qwen3Adapter()
    tok = adapter.build_tokenizer(config)
    actor = TorchActor(config=config, runtime=default_runtime(config), adapter=adapter, tokenizer=tok)
    engine = TorchEngine(config=config, runtime=default_runtime(config), adapter=adapter, tokenizer=tok, model=actor.model)
    return config, actor, engine


def rollout(engine, config, n=4):
    samples = [Sample(id=f"p{i}/0", prompt_ids=[5 + i, 40, 41], seed=i) for i in range(n)]
    return engine.generate(samples, SamplingParams.from_config(config))


def test_publish_commits_and_engine_serves_new_weights(setup):
    config, actor, engine = setup
    ledger = VersionLedger()
    samples = rollout(engine, config)
    old = actor.logprobs(samples)
    actor.train_step(samples, {"old_logprobs": old, "advantages": [torch.ones_like(o) for o in old]})
    new = actor.logprobs(samples)
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(new, old, strict=True))

    sync = InProcessSync(config=config)
    receipts, manifest = sync.publish(actor, engine, version=1)
    assert manifest == fingerprint(actor.named_weights())
    assert [r.fingerprint for r in receipts] == [manifest]
    assert receipts[0].version == 1 and receipts[0].num_tensors == len(list(actor.named_weights()))
    ledger.commit(1, receipts, manifest)
    assert ledger.version == 1 and engine.weight_version == 1
    # the engine holds copies with the actor's values, not aliases of its tensors
    eng_state = engine.model.state_dict()
    for name, t in actor.named_weights():
        assert torch.equal(eng_state[name], t)
        assert eng_state[name].data_ptr() != t.data_ptr()
    # and it now samples from the trained policy: its log-probs equal the actor's replay
    fresh = rollout(engine, config)
    assert all(s.versions == [1] * len(s.response_ids) for s in fresh)
    for s, lp in zip(fresh, actor.logprobs(fresh), strict=True):
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), lp, atol=1e-4, rtol=0)


def test_tampered_receipt_blocks_commit(setup):
    config, actor, engine = setup
    ledger = VersionLedger(version=1)
    sync = InProcessSync(config=config)
    receipts, manifest = sync.publish(actor, engine, version=2)
    bad = [dataclasses.replace(receipts[0], fingerprint="0" * 64)]
    with pytest.raises(WeightSyncError, match="not committed"):
        ledger.commit(2, bad, manifest)
    assert ledger.version == 1
    stale = [dataclasses.replace(receipts[0], version=1)]
    with pytest.raises(WeightSyncError):
        ledger.commit(2, stale, manifest)
    with pytest.raises(WeightSyncError):
        ledger.commit(2, [], manifest)
    assert ledger.version == 1 and ledger.history == []
    ledger.commit(2, receipts, manifest)
    assert ledger.version == 2


def test_publish_casts_to_the_engines_serving_dtype(setup):
    config, actor, _ = setup
    bf16 = RunConfig.model_validate({**config.model_dump(), "rollout": {"options": {"dtype": "bfloat16"}}})
    engine = build_engine(bf16, adapter=Qwen3Adapter(), tokenizer=actor.tokenizer, model=actor.model)
    receipts, manifest = InProcessSync(config=config).publish(actor, engine, version=4)
    assert [r.fingerprint for r in receipts] == [manifest] and engine.weight_version == 4
    state = engine.model.state_dict()
    for name, t in actor.named_weights():
        assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], t.to(torch.bfloat16))


def test_publish_refused_while_a_rollout_is_unreaped(setup):
    config, actor, engine = setup
    version = engine.weight_version
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    samples = [Sample(id=f"u{i}/0", prompt_ids=[5 + i, 40], seed=i) for i in range(2)]
    handle = engine.submit(samples, SamplingParams(max_new_tokens=4))
    with pytest.raises(SyncRefusedError, match="in flight"):
        InProcessSync(config=config).publish(actor, engine, version=version + 1)
    assert engine.weight_version == version
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    while engine.in_flight:
        engine.poll(handle, timeout=1.0)


def test_rejects_options():
    """'inprocess' declares no options: the kernel refuses them before the sync is built."""
    config = RunConfig.model_validate({"weight_sync": {"options": {"bucket_mb": 1}}})
    with pytest.raises(OptionsError) as info:
        load_kernel().build("weight_syncs", "inprocess", options=config.weight_sync.options,
                            options_at="weight_sync.options", config=config)
    assert [(v.field, v.fix) for v in info.value.violations] == [("weight_sync.options", "remove them")]
    assert "bucket_mb" in str(info.value)
