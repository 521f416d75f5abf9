"""The FSDP actor against the embedded actor, for real: gloo, 2 ranks (Ray actors), CPU, fp32.

One Ray session and three rank groups serve the whole module (each group costs seconds to start on
2 cores): ``main`` (2 ranks, value head), ``one`` (1 rank, for 2 -> 1 and 1 -> 2 resumes) and
``faulty`` (2 ranks, rank 1 told to die in the middle of its second train step). The embedded
:class:`~unirl.actor.torch_actor.TorchActor` in this process is the reference for every number.
Every actor gets a runtime built from one kernel; the ranks run ``fsdp_support.DrillWorker`` (probes).
"""

from __future__ import annotations

import random
import time

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")


import fsdp_support  # noqa: E402
from fsdp_support import loss_and_grads  # noqa: E402

from unirl.actor.checkpoint import latest_checkpoint  # noqa: E402
from unirl.actor.torch_actor import TorchActor, micro_batch_loss, step_denominators  # noqa: E402
from unirl.algorithms.losses import LossSettings, ppo_clip  # noqa: E402
from unirl.api import (  # noqa: E402
    Qwen3Adapter,
    RunConfig,
    Sample,
    build_runtime,
    load_kernel,
)
from unirl_fsdp.actor import FSDPActor  # noqa: E402
from unirl_fsdp.group import RankFailedError  # noqa: E402

pytestmark = pytest.mark.ray

TOL = 1e-6
#: weights after several AdamW steps: Adam divides by sqrt(v), which amplifies the 1e-9 summation-order
#: roundoff of small gradients (sharded vs. whole reduction order); a real sharding bug is >= 1e-3
PARAM_TOL = 5e-6
BUILD = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}


def make_config(**actor) -> RunConfig:
    options = {"world_size": 2, "cpus_per_rank": 0.5, "step_timeout_s": 120,
               "worker_cls": fsdp_support.WORKER_CLS, **actor.pop("options", {})}
    return RunConfig.model_validate({
        "model": {"build": BUILD},
        "actor": {"name": "fsdp", "lr": 1e-3, "micro_batch_size": 2, "grad_clip": 1.0, "value_head": True,
                  "options": options, **actor},
        "rollout": {"n": 2, "max_new_tokens": 8},
        "trainer": {"prompts_per_step": 4},
    })


def make_samples(seed: int = 0, groups: int = 4, n: int = 2) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, 259) for _ in range(rng.randrange(3, 9))]
        for k in range(n):
            m = rng.randrange(2, 9)
            mask = [1] * m
            mask[rng.randrange(m)] = 0  # a tool-observation token here and there
            out.append(Sample(id=f"p{g}/{k}", prompt_ids=prompt, loss_mask=mask,
                              response_ids=[rng.randrange(3, 259) for _ in range(m)]))
    return out


def make_batch(samples: list[Sample], old: list, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)

    def like(t, scale=1.0):
        return torch.randn(t.shape, generator=g) * scale

    return {
        "advantages": [like(t) for t in old],
        "old_logprobs": [t + like(t, 0.05) for t in old],
        "ref_logprobs": [t + like(t, 0.05) for t in old],
        "returns": [like(t) for t in old],
        "old_values": [like(t, 0.1) for t in old],
    }


_KERNEL = None


def runtime_for(config: RunConfig, **env: str):
    """The runtime a trainer would hand its actor (one kernel for the module), with ``env`` as the
    merged worker env."""
    global _KERNEL
    _KERNEL = _KERNEL or load_kernel()
    return build_runtime(config, _KERNEL, adapter=Qwen3Adapter(), worker_env=env)


def fsdp(config: RunConfig, adapter, **kw) -> FSDPActor:
    """``actor.options`` of ``config`` validated by the kernel, as a run builds the actor."""
    from unirl.api import build_actor

    env = kw.pop("env", {})
    return build_actor(config, adapter=adapter, runtime=runtime_for(config, **env), **kw)


def reference_loss_and_grads(actor: TorchActor, samples, batch, config):
    """The embedded actor's whole-batch loss and gradients (one micro-batch: the ground truth)."""
    total_tokens, total_seqs = step_denominators(samples)
    actor.optimizer.zero_grad(set_to_none=True)
    loss, _, _ = micro_batch_loss(actor.model, samples, batch, config=config, loss_fn=ppo_clip,
                                  total_tokens=total_tokens, total_seqs=total_seqs, value_head=actor.value_head,
                                  settings=LossSettings.from_algorithm(
                                      config.algorithm, norm_len=config.rollout.max_new_tokens))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
    grads.update({f"value_head.{n}": p.grad.clone() for n, p in actor.value_head.named_parameters()})
    actor.optimizer.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# --------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def config():
    return make_config()


@pytest.fixture(scope="module")
def adapter():
    return Qwen3Adapter()


@pytest.fixture(scope="module")
def torch_actor(config, adapter):
    return TorchActor(config=config, adapter=adapter, runtime=runtime_for(config))


@pytest.fixture(scope="module")
def main(ray_session, config, adapter):
    actor = fsdp(config, adapter, env={"UNIRL_FSDP_TEST_MARK": "main"})
    yield actor
    actor.close()


@pytest.fixture(scope="module")
def data(torch_actor):
    samples = make_samples()
    return samples, make_batch(samples, torch_actor.logprobs(samples))


# ------------------------------------------------------------------------------------------ tests


def test_worker_env_reaches_every_rank(main):
    assert [i["env"].get("UNIRL_FSDP_TEST_MARK") for i in main.group.info] == ["main", "main"]
    assert len({i["pid"] for i in main.group.info}) == 2  # two processes, one per rank


def test_replay_equals_embedded(main, torch_actor, data):
    samples, _ = data
    got, want = main.logprobs(samples), torch_actor.logprobs(samples)
    assert [t.shape for t in got] == [t.shape for t in want]
    assert max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True)) < TOL


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_and_grads_equal_each_aggregation(main, torch_actor, data, config, agg):
    samples, batch = data
    cfg = config.model_copy(deep=True)
    cfg.algorithm.loss_agg = agg
    cfg.algorithm.kl_coef = 0.05  # KL term from batch["ref_logprobs"] included
    want_loss, want = reference_loss_and_grads(torch_actor, samples, batch, cfg)
    got_loss, got = loss_and_grads(main, samples, batch, config=cfg)
    print(f"[{agg}] loss {got_loss:.6g} |dloss| {abs(got_loss - want_loss):.2e} max|dgrad| {max_diff(got, want):.2e}")
    assert abs(got_loss - want_loss) < TOL
    assert max_diff(got, want) < TOL


def test_rank_with_all_tokens_masked(main, torch_actor, data, config):
    samples, batch = data
    shards = main._shard(samples)
    masked = [s.copy() for s in samples]
    for i in shards[1]:
        masked[i].loss_mask = [0] * len(masked[i].response_ids)
    want_loss, want = reference_loss_and_grads(torch_actor, masked, batch, config)
    got_loss, got = loss_and_grads(main, masked, batch)
    print(f"[masked rank] |dloss| {abs(got_loss - want_loss):.2e} max|dgrad| {max_diff(got, want):.2e}")
    assert abs(got_loss - want_loss) < TOL and max_diff(got, want) < TOL


def test_rank_without_samples_pads(main, torch_actor, data, config):
    """One group, kept on one rank: the other rank runs padding micro-batches only."""
    samples, batch = data
    few, fb = samples[:2], {k: v[:2] for k, v in batch.items()}
    assert sorted(len(s) for s in main._shard(few)) == [0, 2]
    want_loss, want = reference_loss_and_grads(torch_actor, few, fb, config)
    got_loss, got = loss_and_grads(main, few, fb)
    assert abs(got_loss - want_loss) < TOL and max_diff(got, want) < TOL


def test_micro_batch_count_does_not_change_update(main, data, config):
    samples, batch = data
    per_rank = max(len(s) for s in main._shard(samples))
    one = config.model_copy(deep=True)
    one.actor.micro_batch_size = per_rank  # 1 micro-batch per rank
    four = config.model_copy(deep=True)
    four.actor.micro_batch_size = 1  # 4 micro-batches per rank
    l1, g1 = loss_and_grads(main, samples, batch, config=one)
    l4, g4 = loss_and_grads(main, samples, batch, config=four)
    assert per_rank == 4
    print(f"[micro 1 vs 4] |dloss| {abs(l1 - l4):.2e} max|dgrad| {max_diff(g1, g4):.2e}")
    assert abs(l1 - l4) < TOL and max_diff(g1, g4) < TOL


def test_three_steps_equal_then_resume_2_to_1_and_1_to_2(main, torch_actor, data, config, adapter, tmp_path_factory):
    samples, batch = data
    for _ in range(3):
        want = torch_actor.train_step(samples, batch)
        got = main.train_step(samples, batch)
        assert abs(got["loss"] - want["loss"]) < TOL
        assert abs(got["grad_norm"] - want["grad_norm"]) < 1e-5
    print(f"[3 steps] max|dparam| {max_diff(dict(main.named_weights()), dict(torch_actor.named_weights())):.2e}")
    assert max_diff(dict(main.named_weights()), dict(torch_actor.named_weights())) < PARAM_TOL
    got_v, want_v = main.values(samples), torch_actor.values(samples)
    assert max(float((a - b).abs().max()) for a, b in zip(got_v, want_v, strict=True)) < TOL

    root = tmp_path_factory.mktemp("ckpt")
    assert main.save(str(root / "step_3"), extra={"cursor": 3}) == str(root / "step_3")
    assert latest_checkpoint(root) == root / "step_3"
    torch_actor.train_step(samples, batch)  # step 4 on the reference

    one = fsdp(make_config(options={"world_size": 1}), adapter)
    try:
        assert one.load(str(root)) == {"cursor": 3}  # 2 -> 1, via the latest pointer
        one.train_step(samples, batch)  # step 4 with the resumed optimizer state
        assert max_diff(dict(one.named_weights()), dict(torch_actor.named_weights())) < PARAM_TOL
        one.save(str(root / "step_4"), extra={"cursor": 4})
    finally:
        one.close()
    assert main.load(str(root)) == {"cursor": 4}  # 1 -> 2
    assert max_diff(dict(main.named_weights()), dict(torch_actor.named_weights())) < PARAM_TOL
    main.train_step(samples, batch)
    torch_actor.train_step(samples, batch)
    assert max_diff(dict(main.named_weights()), dict(torch_actor.named_weights())) < PARAM_TOL


def test_named_weights_stream_matches_embedded_names(main, torch_actor):
    got = list(main.named_weights())
    want = list(torch_actor.named_weights())
    assert [n for n, _ in got] == [n for n, _ in want]  # same order, tied lm_head once
    assert all(t.dtype == torch.float32 and not hasattr(t, "to_local") for _, t in got)


def test_export_hf_loads_in_transformers_with_identical_logits(main, tmp_path):
    from transformers import AutoModelForCausalLM

    main.export_hf(str(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert loaded.config.architectures == ["Qwen3ForCausalLM"]
    plain = AutoModelForCausalLM.from_config(loaded.config).eval()
    plain.load_state_dict(dict(main.named_weights()), strict=False)
    plain.tie_weights()
    ids = torch.tensor([[5, 17, 99, 3, 42, 7, 250, 11]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, plain(ids).logits)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_dead_rank_raises_with_rank_and_cause_and_keeps_last_checkpoint(ray_session, adapter, data,
                                                                        tmp_path_factory):
    samples, batch = data
    root = tmp_path_factory.mktemp("faulty")
    faulty = fsdp(make_config(), adapter, env={fsdp_support.FAULT_ENV: "1:train_step:2"})
    try:
        faulty.train_step(samples, batch)
        faulty.save(str(root / "step_1"))
        saved = dict(faulty.named_weights())
        t0 = time.monotonic()
        with pytest.raises(RankFailedError) as err:
            faulty.train_step(samples, batch)  # rank 1 exits after its first backward
        print(f"[fault] raised after {time.monotonic() - t0:.1f}s: {err.value}")
        assert time.monotonic() - t0 < 60
        assert err.value.rank == 1 and err.value.method == "train_step"
        assert "died" in err.value.cause
        with pytest.raises(RankFailedError):
            faulty.logprobs(samples)  # the group is stopped, not hanging
    finally:
        faulty.close()
    assert latest_checkpoint(root) == root / "step_1"
    resumed = fsdp(make_config(options={"world_size": 1}), adapter)
    try:
        resumed.load(str(root))
        assert resumed.step == 1
        assert max_diff(dict(resumed.named_weights()), saved) == 0.0
    finally:
        resumed.close()


@pytest.mark.parametrize("checkpointing", [True, "selective"])
def test_bf16_compute_with_activation_checkpointing_and_kl_reference(ray_session, adapter, data, checkpointing):
    """bf16 forward/backward over fp32 master weights, blocks recomputed in backward (all of each, or all
    but its matmul and attention outputs: ``selective``), a model handed in by the caller, and a frozen KL
    reference: runs, and stays close to fp32 (not equal: bf16 has 8 mantissa bits)."""
    samples, batch = data
    cfg = make_config(activation_checkpointing=checkpointing,
                      options={"compute_dtype": "bfloat16", "reshard_after_forward": False})
    cfg.algorithm.kl_coef = 0.01
    reference = TorchActor(config=make_config(), adapter=adapter, runtime=runtime_for(cfg))
    actor = fsdp(cfg, adapter, model=adapter.build_model(cfg))
    try:
        ref0 = actor.ref_logprobs(samples)
        got, want = actor.logprobs(samples), reference.logprobs(samples)
        assert max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True)) < 0.1
        assert all(torch.equal(a, b) for a, b in zip(ref0, got, strict=True))  # snapshot of the same weights
        m_got, m_want = actor.train_step(samples, batch), reference.train_step(samples, batch)
        assert abs(m_got["loss"] - m_want["loss"]) < 2e-2
        assert abs(m_got["grad_norm"] - m_want["grad_norm"]) / m_want["grad_norm"] < 0.05
        weights = dict(actor.named_weights())
        assert all(t.dtype == torch.float32 for t in weights.values())  # master stays fp32
        assert all(torch.equal(a, b) for a, b in zip(actor.ref_logprobs(samples), ref0, strict=True))
        actor.snapshot_reference()  # the reference now follows the trained weights
        now = actor.logprobs(samples)
        assert all(torch.equal(a, b) for a, b in zip(actor.ref_logprobs(samples), now, strict=True))
    finally:
        actor.close()
