"""placement: ray: the engine inside one Ray actor, started from the adapter's model (no model.path)."""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.ray]


@pytest.fixture(scope="module")
def ray_engine(require_vllm, tmp_path_factory: pytest.TempPathFactory):
    if os.environ.get("CI", "").lower() == "true":
        import ray
    else:
        ray = pytest.importorskip("ray")
    from unirl.api import Qwen3Adapter, RunConfig, build_engine

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = RunConfig.model_validate({
        "run": {"output_dir": str(tmp_path_factory.mktemp("ray_runs"))},
        "rollout": {"engine": "vllm",
                    "options": {"placement": "ray", "kv_cache_gb": 0.25, "max_model_len": 256,
                                "ignore_eos": True}},
        "weight_sync": {"name": "vllm"},
    })
    engine = build_engine(config, adapter=Qwen3Adapter())
    yield engine, config
    engine.close()
    ray.shutdown()


def test_ray_placement_generates_and_syncs(ray_engine):
    import torch

    from unirl.api import Qwen3Adapter, Sample, SamplingParams, WeightSyncError
    from unirl_vllm.sync import VLLMWeightSync

    engine, config = ray_engine
    assert engine.model_dir.endswith("engine_init")  # built from the adapter, saved with its tokenizer
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)

    def run():
        return engine.generate([Sample(id="p0", prompt_ids=[2, 40, 41, 42])], greedy)[0]

    before = run()
    assert len(before.response_ids) == 8 and before.versions == [0] * 8 and before.response_text

    model = Qwen3Adapter().build_model(config, engine.tokenizer)  # the actor's initial weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))

    class Actor:
        def named_weights(self):
            yield from model.named_parameters()  # tied head not repeated

    receipts, manifest = VLLMWeightSync(config=config).publish(Actor(), engine, version=1)
    assert [(r.worker, r.version, r.fingerprint) for r in receipts] == [(0, 1, manifest)]
    after = run()
    assert after.response_ids != before.response_ids and after.versions == [1] * 8

    with torch.no_grad():  # the engine's answer equals a transformers replay of the synced weights
        ids = torch.tensor([after.prompt_ids + after.response_ids])
        lp = torch.log_softmax(model(input_ids=ids).logits[0, len(after.prompt_ids) - 1 : -1].float(), -1)
        ref = lp.gather(1, torch.tensor(after.response_ids)[:, None])[:, 0]
    assert float((torch.tensor(after.rollout_logprobs) - ref).abs().max()) < 1e-5

    with pytest.raises(WeightSyncError, match="missing"):
        engine.load_weights([(n, p.detach()) for n, p in model.named_parameters()][1:], version=2)
    assert engine.weight_version == 1 and run().response_ids == after.response_ids


def test_ray_placement_aborts_mid_generation(ray_engine):
    """The driver steps the Ray host one engine step at a time, so abort lands mid-generation."""
    import time

    from unirl.api import Sample, SamplingParams

    engine, _ = ray_engine
    samples = [Sample(id=f"r{i}", prompt_ids=[2, 40 + i, 41, 42], seed=i) for i in range(3)]
    handle = engine.submit(samples, SamplingParams(max_new_tokens=240))
    deadline = time.monotonic() + 60
    while not any(s.requests[-1].first_token_ms for s in samples):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    got = engine.abort(handle)
    assert {s.id for s in got} == {s.id for s in samples}
    for s in samples:
        s.validate("vllm")
        assert s.finish_reason == "abort" and 0 < len(s.response_ids) < 240
    assert engine.in_flight == 0 and engine._host.unfinished() == 0
    again = engine.generate([Sample(id="r9", prompt_ids=[2, 40, 41, 42])], SamplingParams(max_new_tokens=4))[0]
    assert len(again.response_ids) == 4 and again.finish_reason == "length"
