"""LoRA through peft on the embedded actor (``actor.lora``, docs/lora.md).

The oracles are peft's own: the published weights must equal ``merge_and_unload()`` of a copy of the
actor's peft model bit for bit, and an exported adapter must load with ``PeftModel.from_pretrained``
in a process that never imports unirl and greedy-decode the tokens the engine decodes.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

if os.environ.get("CI") != "true":
    pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: the helpers beside this file
from test_torch_actor import make_batch, make_samples, tiny_model  # noqa: E402

from unirl.actor import lora  # noqa: E402
from unirl.actor.checkpoint import ADAPTER_FILE, MODEL_FILE, CheckpointError  # noqa: E402
from unirl.actor.torch_actor import TorchActor, hf_named_weights  # noqa: E402
from unirl.config import RunConfig, load_config  # noqa: E402
from unirl.engine.torch_engine import TorchEngine  # noqa: E402
from unirl.kernel.errors import ConfigError  # noqa: E402
from unirl.models.qwen3 import Qwen3Adapter  # noqa: E402
from unirl.sync.inprocess import InProcessSync  # noqa: E402
from unirl.testing import default_runtime

ROOT = Path(__file__).resolve().parents[2]


def lora_config(**lora_kw) -> RunConfig:
    return RunConfig.model_validate({"trainer": {"steps": 10}, "rollout": {"max_new_tokens": 6},
                                     "actor": {"lr": 1e-2, "micro_batch_size": 4, "lora": {"r": 4, **lora_kw}}})


def lora_actor(config: RunConfig, seed: int = 0) -> TorchActor:
    return TorchActor(config=config, runtime=default_runtime(config), adapter=Qwen3Adapter(), model=tiny_model(config, seed=seed))


def adapter_params(actor: TorchActor) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in actor.model.named_parameters() if ".lora_" in n}


def train(actor: TorchActor, steps: int = 2) -> None:
    samples = make_samples()
    for i in range(steps):
        actor.train_step(samples, make_batch(actor, samples, seed=i + 1))


# ------------------------------------------------------------------------------------------ training


def test_only_the_adapter_trains_and_the_optimizers_hold_only_it():
    actor = lora_actor(lora_config())
    adapters = adapter_params(actor)
    assert adapters and all(p.requires_grad for p in adapters.values())
    base = {n: p.detach().clone() for n, p in actor.model.named_parameters() if ".lora_" not in n}
    assert base and not any(p.requires_grad for n, p in actor.model.named_parameters() if ".lora_" not in n)
    # the RL optimizer holds exactly the adapter parameters
    held = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for p in adapters.values()}

    grads: dict[str, torch.Tensor | None] = {}
    orig = actor._clip_and_step

    def capture(opt, params):
        grads.update({n: (p.grad.clone() if p.grad is not None else None) for n, p in actor.model.named_parameters()})
        return orig(opt, params)

    actor._clip_and_step = capture
    b_before = {n: p.detach().clone() for n, p in adapters.items()}
    train(actor, steps=1)
    assert all(grads[n] is None for n in base), "a frozen base weight got a gradient"
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if ".lora_B" in n)
    # the step moved the adapter and left the base bit for bit as it was
    assert any(not torch.equal(b_before[n], p) for n, p in adapters.items())
    now = dict(actor.model.named_parameters())
    assert all(torch.equal(base[n], now[n]) for n in base)
    assert {id(p) for p in actor.optimizer.state} <= {id(p) for p in adapters.values()}
    # the SFT optimizer too
    actor.sft_step(make_samples())
    assert {id(p) for g in actor.sft_optimizer.param_groups for p in g["params"]} == {id(p) for p in adapters.values()}
    assert all(torch.equal(base[n], now[n]) for n in base)


def test_the_adapter_init_is_drawn_from_run_seed_outside_the_process_rng():
    """The embedded actor draws peft's random ``lora_A`` from ``run.seed`` (as every FSDP rank does):
    two actors built at different points of the process's RNG stream get the same adapter, another
    ``run.seed`` gives another, and the process's RNG is left where it was."""
    torch.manual_seed(1)
    a = adapter_params(lora_actor(lora_config()))
    torch.manual_seed(2)
    b = adapter_params(lora_actor(lora_config()))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    other = lora_config()
    other.run.seed = 7
    c = adapter_params(lora_actor(other))
    assert any(not torch.equal(a[n], c[n]) for n in a if "lora_A" in n)
    base = lora_config()
    state = torch.random.get_rng_state()
    lora.apply_lora(tiny_model(base, seed=0), base.actor.lora, seed=base.run.seed)
    assert torch.equal(torch.random.get_rng_state(), state), "the process's RNG did not move"


def test_lora_trains_far_fewer_parameters_than_full_fine_tuning():
    full = TorchActor(config=(full_cfg := RunConfig.model_validate({"actor": {"micro_batch_size": 4}})),
                      runtime=default_runtime(full_cfg), adapter=Qwen3Adapter(),
                      model=tiny_model(lora_config()))
    actor = lora_actor(lora_config())
    n_full = sum(p.numel() for g in full.optimizer.param_groups for p in g["params"])
    n_lora = sum(p.numel() for g in actor.optimizer.param_groups for p in g["params"])
    # r=4 on every linear of 2 layers, hidden 64: 4 * (in + out) per layer, summed
    want = sum(4 * (m.in_features + m.out_features) for n, m in tiny_model(lora_config()).named_modules()
               if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head"))
    assert n_lora == want and n_lora < n_full / 10


# ------------------------------------------------------------------------------------------ weight sync


def test_published_weights_equal_peft_merge_and_unload_bit_for_bit():
    config = lora_config()
    actor = lora_actor(config)
    train(actor, steps=2)
    engine = TorchEngine(config=config, runtime=default_runtime(config), adapter=Qwen3Adapter(), model=tiny_model(config, seed=7))
    receipts, manifest = InProcessSync(config=config).publish(actor, engine, version=1)
    assert [r.fingerprint for r in receipts] == [manifest]

    oracle = dict(hf_named_weights(copy.deepcopy(actor.model).merge_and_unload()))
    served = engine.model.state_dict()
    published = dict(actor.named_weights())
    assert set(published) == set(oracle)  # HF names, the tied head once, no adapter tensors
    for name, t in oracle.items():
        assert torch.equal(served[name], t), name
        assert torch.equal(published[name], t), name
    # the adapter is not a no-op: merged differs from the base where the adapter sits
    base = dict(hf_named_weights(tiny_model(config)))
    assert not torch.equal(oracle["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(oracle["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    # and publishing did not touch the live base weights (an in-place merge would)
    assert torch.equal(actor.model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight,
                       base["model.layers.0.self_attn.q_proj.weight"])


# ------------------------------------------------------------------------------------------ checkpoints


def test_checkpoint_holds_the_adapter_only_and_resume_continues_exactly(tmp_path):
    config = lora_config()
    actor = lora_actor(config)
    train(actor, steps=2)
    path = actor.save(str(tmp_path / "ckpt" / "step_000002"), extra={"cursor": 5})
    files = {p.name for p in Path(path).iterdir()}
    assert ADAPTER_FILE in files and MODEL_FILE not in files
    from safetensors.torch import load_file

    stored = load_file(str(Path(path) / ADAPTER_FILE))
    assert stored and all(".lora_" in k for k in stored)
    assert sum(t.numel() for t in stored.values()) == sum(p.numel() for p in adapter_params(actor).values())

    resumed = lora_actor(config)
    assert resumed.load(str(tmp_path / "ckpt")) == {"cursor": 5}
    assert resumed.step == actor.step
    for (n, a), (m, b) in zip(actor.named_weights(), resumed.named_weights(), strict=True):
        assert n == m and torch.equal(a, b), n
    # the optimizer state came back too: the next step is the same step, bit for bit
    samples = make_samples()
    batch = make_batch(actor, samples, seed=9)
    assert actor.train_step(samples, batch) == resumed.train_step(samples, batch)
    for (n, a), (_, b) in zip(actor.named_weights(), resumed.named_weights(), strict=True):
        assert torch.equal(a, b), n


def test_the_kl_reference_is_checkpointed_as_an_adapter_too(tmp_path):
    config = RunConfig.model_validate({**lora_config().model_dump(), "algorithm": {"kl_coef": 0.1}})
    actor = lora_actor(config)
    train(actor, steps=1)
    actor.snapshot_reference()  # the reference now differs from the base: its adapter is trained
    train(actor, steps=1)
    path = actor.save(str(tmp_path / "step_000002"))
    assert (Path(path) / "reference_adapter.safetensors").is_file()
    assert not (Path(path) / "reference.safetensors").exists()
    resumed = lora_actor(config)
    resumed.load(path)
    samples = make_samples()
    for a, b in zip(actor.ref_logprobs(samples), resumed.ref_logprobs(samples), strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(actor.ref_logprobs(samples), actor.logprobs(samples),
                                                      strict=True))


def test_a_checkpoint_of_another_kind_or_base_is_refused_naming_the_fix(tmp_path):
    config = lora_config()
    actor = lora_actor(config)
    ckpt = actor.save(str(tmp_path / "step_000000"))
    with pytest.raises(CheckpointError, match=r"actor\.lora\.r"):
        lora_actor(lora_config(r=8)).load(ckpt)
    with pytest.raises(CheckpointError, match=r"actor\.lora\.target_modules"):
        lora_actor(lora_config(target_modules=["q_proj"])).load(ckpt)
    with pytest.raises(lora.LoraError, match=r"base weights with fingerprint .* model\.path"):
        lora_actor(config, seed=1).load(ckpt)
    full = TorchActor(config=(full_cfg := RunConfig.model_validate({"actor": {"micro_batch_size": 4}})),
                      runtime=default_runtime(full_cfg), adapter=Qwen3Adapter(),
                      model=tiny_model(config))
    with pytest.raises(CheckpointError, match=r"only a LoRA adapter, but actor\.lora is not set"):
        full.load(ckpt)
    full_ckpt = full.save(str(tmp_path / "step_000001"))
    with pytest.raises(CheckpointError, match=r"holds full weights.*unset actor\.lora"):
        actor.load(full_ckpt)


# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(("lora_section", "words"), [
    ({"r": 0}, "actor.lora.r"),
    ({"alpha": 0}, "actor.lora.alpha"),
    ({"dropout": 1.0}, "actor.lora.dropout"),
    ({"target_modules": []}, "target_modules is empty"),
    ({"target_modules": ["q_proj", "lm_head"]}, "['lm_head']"),
    ({"rank": 4}, "actor.lora.rank: unknown key. Valid keys here: r, alpha, dropout, target_modules"),
])
def test_bad_lora_config_names_the_field_and_fix(lora_section, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"actor.lora={json.dumps(lora_section)}"])
    assert words in str(err.value), str(err.value)


def test_target_modules_that_match_nothing_list_the_models_linear_layers():
    with pytest.raises(lora.LoraError) as err:
        lora_actor(lora_config(target_modules=["qproj"]))
    msg = str(err.value)
    assert "actor.lora.target_modules ['qproj']" in msg and "q_proj" in msg and "all-linear" in msg


def test_actors_without_an_adapter_refuse_an_adapter_export(tmp_path):
    full = TorchActor(config=(full_cfg := RunConfig.model_validate({"actor": {"micro_batch_size": 4}})),
                      runtime=default_runtime(full_cfg), adapter=Qwen3Adapter(),
                      model=tiny_model(lora_config()))
    with pytest.raises(ConfigError, match="trains no LoRA adapter"):
        full.export_adapter(str(tmp_path / "a"))
    assert not (tmp_path / "a").exists()


# ------------------------------------------------------------------------------------------ export


SMALL = [
    "sft.steps=4", "sft.batch_size=8", "trainer.steps=2", "trainer.prompts_per_step=4", "trainer.eval_every=0",
    "trainer.eval_k=1", "trainer.progress=false", "trainer.plot=false", "trainer.export_hf=false",
    "data.arith.n_train=32", "data.arith.n_eval=6", "rollout.n=2", "rollout.max_new_tokens=4",
    "sft.lr=3e-2", "actor.lr=3e-2", "actor.lora={r: 4, alpha: 8}",
]

PLAIN = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM
    from peft import PeftModel
    assert not any(m == "unirl" or m.startswith("unirl.") for m in sys.modules)
    merged_dir, base_dir, adapter_dir, prompts, n = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                           adapter_dir).eval()
    out = {}
    for name, model in (("merged", merged), ("adapter", peft_model)):
        toks = []
        for p in prompts:
            with torch.no_grad():
                g = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   max_new_tokens=n, do_sample=False)
            toks.append(g[0, len(p):].tolist())
        out[name] = toks
    assert not any(m == "unirl" or m.startswith("unirl.") for m in sys.modules)
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_exports_load_in_plain_transformers_and_peft_and_decode_like_the_engine(tmp_path):
    from unirl.contracts import SamplingParams
    from unirl.export import export_run
    from unirl.kernel import load_kernel
    from unirl.samples import Sample
    from unirl.trainer.loop import build_components
    from unirl.trainer.loop import train as train_run

    # a saved base (the tiny Qwen3 the demo builds), so the adapter has a base directory to load onto
    base_cfg = load_config(ROOT / "recipes" / "arith-tiny.yaml", ["trainer.progress=false"])
    c = build_components(base_cfg, load_kernel(), rollouts=False)
    try:
        c.actor.export_hf(str(tmp_path / "base"))
    finally:
        c.close()
    config = load_config(ROOT / "recipes" / "arith-tiny.yaml",
                         [*SMALL, f"model.path={tmp_path / 'base'}", f"run.output_dir={tmp_path}", "run.name=r"])
    train_run(config, load_kernel())
    run = config.run_dir
    merged = export_run(run, out=tmp_path / "merged")
    adapter = export_run(run, adapter=True)
    assert adapter == run / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "base")
    assert not (merged / "adapter_config.json").exists() and (merged / "model.safetensors").is_file()
    from safetensors.torch import load_file

    trained = load_file(str(adapter / "adapter_model.safetensors"))
    assert any(".lora_B" in k and t.abs().sum() > 0 for k, t in trained.items())  # B starts at 0: it learned

    # the engine, given the actor's published (merged) weights, greedy-decodes some prompts
    c = build_components(config, load_kernel())
    try:
        c.actor.load(str(run / "checkpoints"))
        c.sync.publish(c.actor, c.engine, version=1)
        tok = c.tokenizer
        prompts = [tok.encode(f"Q: {a}+{b}=? A:", add_special_tokens=False) for a, b in [(3, 4), (8, 1), (5, 5)]]
        n = 6
        done = c.engine.generate([Sample(id=f"p{i}/0", prompt_ids=p) for i, p in enumerate(prompts)],
                                 SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
        engine_tokens = [s.response_ids for s in done]
    finally:
        c.close()
    out = subprocess.run([sys.executable, "-c", PLAIN, str(merged), str(tmp_path / "base"), str(adapter),
                          json.dumps(prompts), str(n)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])

    def upto_eos(toks: list[int]) -> list[int]:  # transformers stops at eos (and pads after it)
        return toks[:toks.index(tok.eos_token_id) + 1] if tok.eos_token_id in toks else toks

    assert all(len(t) == n for t in engine_tokens)
    assert [upto_eos(t) for t in engine_tokens] == got["merged"] == got["adapter"]


def test_adapter_export_is_refused_for_a_full_fine_tuning_run_or_a_scratch_base(tmp_path):
    from unirl.export import export_run

    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text("run: {name: r}\n")
    with pytest.raises(ConfigError, match="no actor.lora"):
        export_run(run, adapter=True)
    (run / "config.yaml").write_text("run: {name: r}\nactor: {lora: {r: 4}}\n")
    with pytest.raises(ConfigError, match="model.path is unset"):
        export_run(run, adapter=True)


# ------------------------------------------------------------------------------------------ adapter-only sync


def test_adapter_sync_needs_an_engine_that_serves_adapters(tmp_path):
    """``actor.lora.sync: adapter`` is refused by preflight for the embedded engine (it declares no
    ``lora_adapters``), naming the field and the fix; the contract's default ``load_adapter`` refuses too.
    vLLM's side: ``plugins/unirl-vllm/tests/test_vllm_lora.py``."""
    from unirl.kernel.manager import load_kernel
    from unirl.preflight import preflight

    kernel = load_kernel()
    config = RunConfig.model_validate({"run": {"output_dir": str(tmp_path)}, "actor": {"lora": {"sync": "adapter"}}})
    found = [str(v) for v in preflight(config, kernel) if v.field == "actor.lora.sync"]
    assert found and "lora_adapters" in found[0] and "actor.lora.sync: merged" in found[0]
    merged = RunConfig.model_validate({"run": {"output_dir": str(tmp_path)}, "actor": {"lora": {}}})
    assert merged.actor.lora.sync == "merged"
    assert not [v for v in preflight(merged, kernel) if v.field == "actor.lora.sync"]

    actor = lora_actor(config)
    engine = TorchEngine(config=config, runtime=default_runtime(config), adapter=Qwen3Adapter(), model=tiny_model(config))
    with pytest.raises(ConfigError, match="actor.lora.sync: merged"):
        InProcessSync(config=config).publish(actor, engine, version=1)
