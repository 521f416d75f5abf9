"""R3 (``algorithm.routing_replay``) on the FSDP actor: 2 gloo ranks (Ray actors) replay the recorded
experts exactly as the embedded actor does, and on each rank every response token's experts, as the
routers hand them on, equal the engine's record (``r3_probe.R3ProbeWorker`` hooks the routers there).

Oracle: the embedded actor with the replay (core's ``test_routing_replay`` checks that one against the
records and against a hand-written layer). The records come from an engine whose routers were
perturbed, so many of them differ from the trainer's own choice: an FSDP actor that ignored them would
match the embedded actor *without* replay instead, and that one differs."""

from __future__ import annotations

import copy

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

from unirl.actor.torch_actor import TorchActor  # noqa: E402
from unirl.api import (  # noqa: E402
    RunConfig,
    Sample,
    SamplingParams,
    build_actor,
    build_demo_tokenizer,
    build_engine,
    build_runtime,
    load_kernel,
)
from unirl.models.qwen3_moe import Qwen3MoeAdapter  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _config(replay: bool, actor: str) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"adapter": "qwen3_moe"},
        "actor": {"name": actor, "micro_batch_size": 2, "options": {
            "world_size": 2, "cpus_per_rank": 0.5, "step_timeout_s": 120,
            "worker_cls": "r3_probe:R3ProbeWorker"} if actor == "fsdp" else {}},
        "rollout": {"n": 2, "max_new_tokens": 8},
        "algorithm": {"routing_replay": replay},
    })


def test_fsdp_replays_the_recorded_experts(ray_session):
    kernel, adapter, tok = load_kernel(), Qwen3MoeAdapter(), build_demo_tokenizer()
    on, off = _config(True, "torch"), _config(False, "torch")
    embedded = TorchActor(config=on, adapter=adapter, runtime=build_runtime(on, kernel, adapter=adapter), tokenizer=tok)
    plain = TorchActor(config=off, adapter=adapter, runtime=build_runtime(off, kernel, adapter=adapter), tokenizer=tok)
    perturbed = copy.deepcopy(embedded.model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for r in adapter.routers(perturbed):
            r.module.weight.add_(torch.randn(r.module.weight.shape, generator=g) * r.module.weight.std())
    engine = build_engine(on, adapter=adapter, tokenizer=tok, model=perturbed)
    prompts = ["Q: 1+2=? A:", "Q: 12+7=? A:", "Q: 3-15=? A:", "Q: 9*9=? A:"]
    samples = engine.generate([Sample(id=f"p{i}/0", prompt_ids=tok.encode(p), seed=i) for i, p in enumerate(prompts)],
                              SamplingParams(max_new_tokens=8, temperature=1.0))
    assert all(s.routing is not None for s in samples)
    want = torch.cat(embedded.logprobs(samples))
    own = torch.cat(plain.logprobs(samples))
    assert float((want - own).abs().max()) > 1e-3  # the records re-route: replay changes the log-probs
    fsdp_on = _config(True, "fsdp")
    actor = build_actor(fsdp_on, adapter=adapter, runtime=build_runtime(fsdp_on, kernel, adapter=adapter),
                        tokenizer=tok)
    try:
        got = torch.cat(actor.logprobs(samples))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        _assert_ranks_route_to_the_records(actor, samples)
        batch = {"advantages": [torch.ones(len(s.response_ids)) for s in samples]}
        metrics = actor.train_step(samples, batch)
        assert 0.0 < metrics["routing/agreement"] < 1.0  # the perturbed router's records, measured on the ranks
    finally:
        actor.close()


def _assert_ranks_route_to_the_records(actor, samples) -> None:
    """Each rank's routers, over a log-prob replay of all samples: wherever the plan holds a record, the
    ids passed on equal it; and the planned rows are exactly the samples' records (every recorded
    response token, once), read from ``Sample.routing`` here, not from the rank."""
    recorded = sorted(tuple(map(tuple, row.tolist())) for s in samples for row in s.routing.astype(np.int64)
                      if (row >= 0).all())
    assert recorded
    for rank, forwards in enumerate(actor.group.call("replayed_experts", samples, -(-len(samples) // 2))):
        planned = []
        for f in forwards:
            ids, plan = f["ids"], f["plan"]
            has = (plan[:, :, 0] >= 0).all(-1)
            assert torch.equal(ids[has], plan[has][..., : ids.shape[-1]]), rank
            planned += [tuple(map(tuple, row.tolist())) for row in plan[has][..., : ids.shape[-1]]]
        assert sorted(planned) == recorded, rank
