"""One kernel per run: a plugin registered in-process in the trainer's kernel reaches every actor.

``fsdp_support`` is registered as the plugin ``probe`` (``load_kernel(extra=...)``, no entry point).
Its ``unirl_before_backward`` records every call; the runtime built from that kernel is handed to the
embedded actor and to a 2-rank FSDP actor (gloo, CPU, real Ray), and the trainer's callback
(``runtime.before_backward()``) is installed on both. The hook must then run in this process for the
embedded actor and in both rank processes for FSDP, with the right step / update / micro-batch / rank,
and with log-probs aligned with the rollout log-probs. A rank that built its own kernel would not
know the probe and record nothing.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

import fsdp_support  # noqa: E402
from fsdp_support import read_probe  # noqa: E402

from unirl.actor.torch_actor import TorchActor  # noqa: E402
from unirl.api import (  # noqa: E402
    Qwen3Adapter,
    RunConfig,
    Sample,
    StepInfo,
    build_actor,
    build_runtime,
    load_kernel,
)
from unirl_fsdp.actor import UnpicklableCallbackError  # noqa: E402
from unirl_fsdp.group import RankFailedError  # noqa: E402

pytestmark = pytest.mark.ray

BUILD = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}


def make_config(out: Path, name: str) -> RunConfig:
    return RunConfig.model_validate({
        "run": {"output_dir": str(out / name)},
        "model": {"build": BUILD},
        "actor": {"name": "fsdp", "lr": 1e-3, "micro_batch_size": 2,
                  "options": {"world_size": 2, "cpus_per_rank": 0.5, "step_timeout_s": 120}},
        "algorithm": {"estimator": "grpo"},
        "rollout": {"n": 2, "max_new_tokens": 8},
        "trainer": {"prompts_per_step": 3},
    })


def make_samples() -> list[Sample]:
    """Three groups of two; group sizes make the ranks' micro-batch counts differ (padding runs)."""
    out = []
    lens = [[3, 5], [2, 4], [6, 1]]
    for g, pair in enumerate(lens):
        for k, m in enumerate(pair):
            out.append(Sample(id=f"p{g}/{k}", prompt_ids=[5 + g, 6, 7], response_ids=[8 + k] * m,
                              loss_mask=[1] * m))
    return out


def make_batch(samples: list[Sample]) -> dict:
    g = torch.Generator().manual_seed(0)
    shapes = [len(s.response_ids) for s in samples]
    return {"advantages": [torch.randn(n, generator=g) for n in shapes],
            "old_logprobs": [torch.full((n,), -5.0) for n in shapes],
            "rollout_logprobs": [torch.full((n,), -5.1) for n in shapes]}


@pytest.fixture(scope="module")
def kernel():
    k = load_kernel(extra=[("probe", fsdp_support)])
    assert k.implements("unirl_before_backward")
    return k


def test_hook_runs_on_the_embedded_actor(kernel, tmp_path):
    config = make_config(tmp_path, "torch")
    runtime = build_runtime(config, kernel, adapter=Qwen3Adapter(), worker_env={})
    actor = TorchActor(config=config, adapter=Qwen3Adapter(), runtime=runtime)
    actor.set_before_backward(runtime.before_backward())
    samples = make_samples()
    actor.train_step(samples, make_batch(samples), StepInfo(rl_step=3, update=1))
    recs = read_probe(config.run.output_dir)
    assert {r["pid"] for r in recs} == {os.getpid()}
    assert [(r["rank"], r["world_size"], r["rl_step"], r["update"], r["micro_batch"], r["n_samples"])
            for r in recs] == [(0, 1, 3, 1, i, 2) for i in range(3)]
    assert all(r["aligned"] and r["detached"] and r["n_logprobs"] == r["n_tokens"] for r in recs)
    assert [i for r in recs for i in r["ids"]] == [s.id for s in samples]


def test_hook_runs_on_every_fsdp_rank_with_the_trainers_kernel(ray_session, kernel, tmp_path):
    config = make_config(tmp_path, "fsdp")
    runtime = build_runtime(config, kernel, adapter=Qwen3Adapter(), worker_env={})
    assert runtime.estimator.needs_groups
    actor = build_actor(config, adapter=Qwen3Adapter(), runtime=runtime)
    try:
        assert actor.keep_groups  # from runtime.estimator, not from the estimator's name
        with pytest.raises(UnpicklableCallbackError, match="cannot be pickled"):
            lock = threading.Lock()
            actor.set_before_backward(lambda ctx: lock.acquire())
        actor.set_before_backward(runtime.before_backward())
        samples = make_samples()
        batch = make_batch(samples)
        actor.train_step(samples, batch, StepInfo(rl_step=4, update=2))
        recs = read_probe(config.run.output_dir)
        assert os.getpid() not in {r["pid"] for r in recs}  # ran in the ranks, not here
        by_rank = {r["rank"]: [x for x in recs if x["rank"] == r["rank"]] for r in recs}
        assert sorted(by_rank) == [0, 1]
        assert len({x["pid"] for x in recs}) == 2
        assert all((r["world_size"], r["rl_step"], r["update"]) == (2, 4, 2) for r in recs)
        # every rank ran the same number of micro-batches (2 groups on one rank, 1 + a padding one on
        # the other); the padding micro-batch shows as no samples and empty tensors
        assert [len(v) for v in by_rank.values()] == [2, 2]
        for rank_recs in by_rank.values():
            assert [r["micro_batch"] for r in rank_recs] == [0, 1]
        pads = [r for r in recs if r["n_samples"] == 0]
        assert len(pads) == 1 and pads[0]["n_logprobs"] == 0 and pads[0]["aligned"]
        assert sorted(i for r in recs for i in r["ids"]) == sorted(s.id for s in samples)
        assert all(r["aligned"] and r["detached"] and r["n_logprobs"] == r["n_tokens"] for r in recs)

        # the gate is collective-safe: one rank raising stops both, neither hangs in a collective
        actor.set_before_backward(fsdp_support.RaiseOnRank(1))
        with pytest.raises(RankFailedError) as err:
            actor.train_step(samples, batch, StepInfo(rl_step=5))
        assert "drift on rank 1" in str(err.value)
        assert err.value.rank == 1 and "GateFailedElsewhere" in err.value.others.get(0, "")
    finally:
        actor.close()
