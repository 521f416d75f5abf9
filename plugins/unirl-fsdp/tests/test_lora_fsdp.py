"""LoRA (``actor.lora``) on the FSDP actor, for real: peft adapters under FSDP2 ``fully_shard``, gloo, 2 ranks.

The oracles are peft's and the embedded actor's, never this plugin's own code: the merged weights the
ranks publish must equal ``merge_and_unload()`` of the adapter they export, loaded onto a freshly built
base in this process, bit for bit; the base fingerprint a checkpoint stores is the embedded actor's
:func:`unirl.api.base_fingerprint` of the same base; a resumed actor must take the next step bit for bit
as the one that saved. The slow test runs ``recipes/arith-tiny-fsdp.yaml`` with ``actor.lora`` through
``unirl.api.train``: 2 steps, a resume to step 3, and the engine's receipt checked against the merge.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
if os.environ.get("CI") != "true":
    pytest.importorskip("peft")

import fsdp_support  # noqa: E402
from fsdp_support import loss_and_grads  # noqa: E402
from test_fsdp_actor import BUILD, make_batch, make_samples  # noqa: E402

from unirl.api import (  # noqa: E402
    CheckpointError,
    LoraError,
    Qwen3Adapter,
    RunConfig,
    apply_lora,
    base_fingerprint,
    build_runtime,
    fingerprint,
    hf_named_weights,
    load_kernel,
)
from unirl_fsdp.actor import FSDPActor, check_lora_checkpoint  # noqa: E402
from unirl_fsdp.options import FSDPOptions  # noqa: E402

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[3]
ADAPTED = "model.layers.0.self_attn.q_proj.weight"
NOT_ADAPTED = ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight")


def lora_config(**lora) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"build": BUILD},
        "actor": {"name": "fsdp", "lr": 1e-2, "micro_batch_size": 2, "grad_clip": 1.0, "lora": {"r": 4, **lora},
                  "options": {"world_size": 2, "cpus_per_rank": 0.5, "step_timeout_s": 120,
                              "worker_cls": fsdp_support.WORKER_CLS}},
        "rollout": {"n": 2, "max_new_tokens": 8},
        "trainer": {"prompts_per_step": 4},
    })


def fsdp(config: RunConfig) -> FSDPActor:
    """As a run builds it: the kernel's runtime, ``actor.options`` validated."""
    adapter = Qwen3Adapter()
    runtime = build_runtime(config, load_kernel(), adapter=adapter)
    return FSDPActor(config=config, adapter=adapter, runtime=runtime,
                     options=FSDPOptions.model_validate(config.actor.options))


def fresh_base(config: RunConfig) -> torch.nn.Module:
    """The base every rank builds (seeded ``model.build``), built again here."""
    return Qwen3Adapter().build_model(config).float()


@pytest.fixture(scope="module")
def config():
    return lora_config()


@pytest.fixture(scope="module")
def actor(ray_session, config):
    a = fsdp(config)
    yield a
    a.close()


@pytest.fixture(scope="module")
def data(actor):
    samples = make_samples()
    batch = make_batch(samples, actor.logprobs(samples))
    del batch["old_values"], batch["returns"]  # no value head
    return samples, batch


def test_only_the_adapter_trains_and_the_optimizer_holds_only_it(actor, data):
    held = actor.group.call_rank(0, "trainable")
    assert held["requires_grad"] and all(".lora_" in n for n in held["requires_grad"])
    assert held["optimizer"] == held["requires_grad"]  # AdamW state: 2 x the adapter, nothing of the base
    # 2 layers x 7 linear layers x (lora_A, lora_B)
    assert len(held["requires_grad"]) == 2 * 7 * 2
    samples, batch = data
    loss, grads = loss_and_grads(actor, samples, batch)
    assert set(grads) == set(held["requires_grad"]), "FSDP reduced a gradient for a frozen base weight"
    # lora_B starts at 0, so only B gets a non-zero gradient in the first step (dL/dA = B^T ...)
    assert any(float(g.abs().max()) > 0 for n, g in grads.items() if ".lora_B." in n)


def test_the_base_fingerprint_is_the_embedded_actors(actor, config):
    """The fingerprint a checkpoint stores is :func:`base_fingerprint` of the same base (the embedded
    actor's), computed by the ranks before sharding; another base gives another."""
    assert actor.lora_base == base_fingerprint(apply_lora(fresh_base(config), config.actor.lora))
    other = lora_config()
    other.run.seed = 1
    assert actor.lora_base != base_fingerprint(apply_lora(fresh_base(other), other.actor.lora))


def test_seeded_adapter_and_its_gradients_equal_the_embedded_actors(actor, data, config, tmp_path):
    """Every rank drew the same ``lora_A`` from ``run.seed`` (the gathered adapter is the one
    ``apply_lora(..., seed=)`` draws in this process, not a mix of shards), and the embedded actor holding
    that adapter computes the same loss and adapter gradients (to float summation order)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file
    from test_fsdp_actor import TOL, max_diff

    from unirl.actor.torch_actor import TorchActor, micro_batch_loss, step_denominators

    actor.export_adapter(str(tmp_path / "a0"))
    exported = load_file(str(tmp_path / "a0" / "adapter_model.safetensors"))
    seeded = get_peft_model_state_dict(apply_lora(fresh_base(config), config.actor.lora, seed=config.run.seed))
    assert set(exported) == set(seeded) and all(torch.equal(exported[k], seeded[k]) for k in seeded)

    emb_cfg = config.model_copy(deep=True)
    emb_cfg.actor.name, emb_cfg.actor.options = "torch", {}
    adapter = Qwen3Adapter()
    emb = TorchActor(config=emb_cfg, adapter=adapter, runtime=build_runtime(emb_cfg, load_kernel(), adapter=adapter))
    set_peft_model_state_dict(emb.model, exported)
    samples, batch = data
    tokens, seqs = step_denominators(samples)
    loss, _, _ = micro_batch_loss(emb.model, samples, batch, config=emb_cfg, loss_fn=emb.runtime.policy_loss,
                                  settings=emb.runtime.loss_settings, total_tokens=tokens, total_seqs=seqs)
    loss.backward()
    want = {n: p.grad for n, p in emb.model.named_parameters() if p.grad is not None}
    got_loss, got = loss_and_grads(actor, samples, batch)
    print(f"[lora vs embedded] |dloss| {abs(got_loss - float(loss)):.2e} max|dgrad| {max_diff(got, want):.2e}")
    assert abs(got_loss - float(loss)) < TOL and max_diff(got, want) < TOL


def test_merged_weights_equal_peft_merge_and_unload_bit_for_bit(actor, data, config, tmp_path):
    from peft import PeftModel

    samples, batch = data
    before = dict(actor.named_weights())
    base = dict(hf_named_weights(fresh_base(config)))
    assert all(torch.equal(before[n], base[n]) for n in base)  # lora_B = 0: the merge is the base
    for _ in range(2):
        actor.train_step(samples, batch)
    published = list(actor.named_weights())
    actor.export_adapter(str(tmp_path / "adapter"))
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4
    peft_model = PeftModel.from_pretrained(fresh_base(config), str(tmp_path / "adapter"))
    oracle = list(hf_named_weights(peft_model.merge_and_unload()))
    assert [n for n, _ in published] == [n for n, _ in oracle]  # HF names and order, tied head once
    for (name, got), (_, want) in zip(published, oracle, strict=True):
        assert torch.equal(got, want), name
    got = dict(published)
    assert not torch.equal(got[ADAPTED], base[ADAPTED])  # the adapter trained
    for name in NOT_ADAPTED:  # and nothing else moved
        assert torch.equal(got[name], base[name]), name


def test_checkpoint_holds_the_adapter_only_and_resume_continues_exactly(actor, data, config, tmp_path):
    import torch.distributed.checkpoint as dcp

    samples, batch = data
    actor.train_step(samples, batch)
    path = Path(actor.save(str(tmp_path / "step_3"), extra={"cursor": 3}))
    meta = json.loads((path / "meta.json").read_text())
    assert meta["adapter"] == actor.adapter_shapes and all(".lora_" in k for k in meta["adapter"])
    stored = dcp.FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in stored if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), "a frozen base weight was checkpointed"
    assert {k.split(".", 1)[1] for k in model_keys} == set(meta["adapter"])
    assert any(k.startswith("optim.state.") for k in stored)
    assert all(".lora_" in k for k in stored if k.startswith("optim.state."))

    resumed = fsdp(config)
    try:
        assert resumed.load(str(tmp_path)) == {"cursor": 3}
        assert resumed.step == actor.step
        want, got = actor.train_step(samples, batch), resumed.train_step(samples, batch)
        assert got == want  # the same AdamW state and schedule: the same step, every metric
        for (n, a), (m, b) in zip(actor.named_weights(), resumed.named_weights(), strict=True):
            assert n == m and torch.equal(a, b), n
    finally:
        resumed.close()

    # what a checkpoint must match, checked before any rank loads (a rank's error would stop the group)
    shapes = dict(actor.adapter_shapes)
    with pytest.raises(LoraError, match=r"actor\.lora: .* base weights with fingerprint .* model\.path"):
        check_lora_checkpoint(str(path), lora_base="0" * 64, adapter_shapes=shapes)
    wider = {k: [8 if d == 4 else d for d in v] for k, v in shapes.items()}
    with pytest.raises(CheckpointError, match=r"actor\.lora\.r"):
        check_lora_checkpoint(str(path), lora_base=actor.lora_base, adapter_shapes=wider)
    fewer = {k: v for k, v in shapes.items() if "q_proj" in k}
    with pytest.raises(CheckpointError, match=r"actor\.lora\.target_modules"):
        check_lora_checkpoint(str(path), lora_base=actor.lora_base, adapter_shapes=fewer)
    with pytest.raises(CheckpointError, match=r"only a LoRA adapter, but actor\.lora is not set"):
        check_lora_checkpoint(str(path), lora_base=None, adapter_shapes={})


@pytest.mark.slow  # two group starts in sequence: 72 s on the shared 2 cores
def test_value_head_kl_reference_bf16_and_checkpointing_with_lora(ray_session, tmp_path):
    """The paths beside the adapter: a value head (trains whole, checkpointed whole), a KL reference (a
    second peft-wrapped sharded model, checkpointed as an adapter), bf16 compute over fp32 masters and
    activation checkpointing. One group at a time (the module's ``actor`` holds the other CPU)."""
    import torch.distributed.checkpoint as dcp

    cfg = lora_config()
    cfg.actor.value_head = True
    cfg.actor.activation_checkpointing = True
    cfg.actor.options["compute_dtype"] = "bfloat16"
    cfg.algorithm.kl_coef = 0.05
    samples = make_samples()
    first = fsdp(cfg)
    try:
        held = first.group.call_rank(0, "trainable")
        assert all(".lora_" in n for n in held["requires_grad"])
        assert held["optimizer"].count("<not a policy parameter>") == 2  # the value head's weight and bias
        batch = make_batch(samples, first.logprobs(samples))
        first.train_step(samples, batch)
        first.snapshot_reference()  # the reference's adapter is now a trained one
        first.train_step(samples, batch)
        path = Path(first.save(str(tmp_path / "step_2")))
        stored = dcp.FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata
        assert {k.split(".")[0] for k in stored} >= {"model", "optim", "reference"}
        for k in stored:
            if k.startswith(("model.", "reference.")):
                assert ".lora_" in k or k.startswith("model.value_head."), k
        assert any(k.startswith("model.value_head.") for k in stored)
        ref = first.ref_logprobs(samples)
        want = first.train_step(samples, batch)
        want_w = dict(first.named_weights())
    finally:
        first.close()
    resumed = fsdp(cfg)
    try:
        resumed.load(str(path))
        assert all(torch.equal(a, b) for a, b in zip(resumed.ref_logprobs(samples), ref, strict=True))
        assert resumed.train_step(samples, batch) == want
        got_w = dict(resumed.named_weights())
        assert all(torch.equal(got_w[n], want_w[n]) for n in want_w)
        assert all(t.dtype == torch.float32 for t in got_w.values())
    finally:
        resumed.close()


# ------------------------------------------------------------------------------------------ the recipe


def _receipt_prints(run_dir: Path) -> list[str]:
    lines = (run_dir / "weights.log").read_text().splitlines()
    return [line.split("fingerprint ")[1].split(",")[0] for line in lines]


@pytest.mark.slow
def test_recipe_with_lora_trains_the_adapter_publishes_merged_weights_and_resumes(tmp_path):
    """``arith-tiny-fsdp.yaml`` + ``actor.lora`` through ``unirl.api.train``: 2 steps, then a resume to 3."""
    import digit_reward
    from transformers import AutoModelForCausalLM

    from unirl.api import load_config, train

    def kernel():  # exact_int scores 0 for every completion of the untrained model: no gradient at all
        return load_kernel(extra=[("digit_reward", digit_reward)])

    small = [f"run.output_dir={tmp_path}", "actor.lora={r: 8, alpha: 16}", "actor.options.cpus_per_rank=0.5",
             "reward.name=digits", "actor.lr=1e-2", "actor.lr_schedule=constant",  # run 2 extends run 1
             "sft.steps=0", "trainer.prompts_per_step=4", "rollout.n=4", "algorithm.updates_per_batch=1",
             "trainer.eval_every=0", "trainer.eval_k=1", "data.arith.n_eval=4", "trainer.progress=false",
             "trainer.plot=false"]
    recipe = ROOT / "recipes" / "arith-tiny-fsdp.yaml"
    first = train(load_config(recipe, [*small, "trainer.steps=2"]), kernel())
    run_dir = first.run_dir
    assert first.steps_done == 2
    published_before = len(_receipt_prints(run_dir))
    hf2 = AutoModelForCausalLM.from_pretrained(str(run_dir / "hf"), dtype=torch.float32)
    merged2 = dict(hf_named_weights(hf2))

    # the step-2 checkpoint holds the adapter only
    import torch.distributed.checkpoint as dcp

    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    stored = dcp.FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
    assert [k for k in stored if k.startswith("model.")] and all(".lora_" in k for k in stored if k.startswith("model."))

    second = train(load_config(recipe, [*small, "trainer.steps=3", "run.resume=true"]), kernel())
    assert second.steps_done == 3 and [h["step"] for h in second.history if h["step"] > 0] == [1, 2, 3]
    assert first.history[-1]["grad_norm"] > 0, "no gradient reached the adapter"
    # the resumed run's first publish is the step-2 adapter merged onto the base: the engine's receipt
    # fingerprints exactly the weights of the merged export of run 1
    prints = _receipt_prints(run_dir)
    assert prints[published_before] == fingerprint(merged2.items())[:12]
    assert len(set(prints)) >= 3  # every update moved the merged weights the engine serves
    merged3 = dict(hf_named_weights(AutoModelForCausalLM.from_pretrained(str(run_dir / "hf"), dtype=torch.float32)))
    base = dict(hf_named_weights(fresh_base(load_config(recipe, small))))
    assert not torch.equal(merged2[ADAPTED], base[ADAPTED])  # the adapter trained in run 1
    assert not torch.equal(merged3[ADAPTED], merged2[ADAPTED])  # and again after the resume
    for name in NOT_ADAPTED:  # the base did not move (only the adapted linears differ from it)
        assert torch.equal(merged3[name], base[name]), name
