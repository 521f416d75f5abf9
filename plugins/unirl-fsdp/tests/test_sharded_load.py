"""Sharded loading (:mod:`unirl_fsdp.loading`), for real: gloo ranks on Ray, a Qwen3 written to disk as
multi-file safetensors with an index.

* the law: with ``n`` ranks, each rank's RSS grows by at most ``P / n + 64 MB`` while it loads a
  126 M-parameter model from bf16 files (``P`` its fp32 bytes); the old whole-model-per-rank load
  failed it at 2 and 4 ranks (measured: see the plugin README);
* the bits: the weights and buffers after a sharded load equal, bit for bit, what the old full load
  gave (``from_pretrained(...).float()``, or the seeded ``model.build``), at 1, 2 and 4 ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

import fsdp_support  # noqa: E402

from unirl.api import Qwen3Adapter, RunConfig, build_actor, build_demo_tokenizer, build_runtime, load_kernel  # noqa: E402

pytestmark = pytest.mark.ray

#: 126 M parameters (504 MB in fp32), vocabulary 259: wide layers, few of them, so the test loads fast
LAW_BUILD = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 64}
SMALL_BUILD = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
CACHE = Path(__file__).resolve().parents[3] / ".cache" / "unirl-fsdp-tests"
MARGIN_MB = 64

_KERNEL = None


def make_config(world: int, options: dict | None = None, lora: dict | None = None, **model) -> RunConfig:
    return RunConfig.model_validate({
        "model": model,
        "actor": {"name": "fsdp", "lora": lora, "options": {"world_size": world, "cpus_per_rank": 2 / world, "threads_per_rank": 1,
                                              "step_timeout_s": 300, "worker_cls": fsdp_support.WORKER_CLS,
                                              **(options or {})}},
    })


def fsdp(config: RunConfig, adapter=None):
    global _KERNEL
    _KERNEL = _KERNEL or load_kernel()
    adapter = adapter or Qwen3Adapter()
    return build_actor(config, adapter=adapter, runtime=build_runtime(config, _KERNEL, adapter=adapter))


def write_model(out: Path, build: dict, *, shard: str, tied: bool = True, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> Path:
    """A random Qwen3 saved as ``save_pretrained`` writes it (in ``dtype``, split into files of ``shard``
    with ``model.safetensors.index.json``) with the demo tokenizer, once: later calls reuse the directory."""
    if (out / "config.json").is_file():
        return out
    from transformers import Qwen3ForCausalLM

    tok = build_demo_tokenizer()
    config = RunConfig.model_validate({"model": {"build": {**build, "tie_word_embeddings": tied}}})
    hf = Qwen3Adapter().hf_config(config, tok)
    torch.manual_seed(seed)
    tmp = out.with_name(out.name + ".tmp")
    Qwen3ForCausalLM(hf).to(dtype).save_pretrained(str(tmp), max_shard_size=shard)
    tok.save_pretrained(str(tmp))
    assert (tmp / "model.safetensors.index.json").is_file()
    tmp.rename(out)
    return out


def fp32_bytes(path: Path) -> int:
    """The model's parameter bytes in fp32 (the files hold bf16: half of it)."""
    return 2 * json.loads((path / "model.safetensors.index.json").read_text())["metadata"]["total_size"]


@pytest.fixture(scope="module")
def law_dir() -> Path:
    """bf16 files, as published checkpoints are; the run's ``model.dtype: bfloat16``, fp32 master weights."""
    return write_model(CACHE / "qwen3-126m-law-bf16", LAW_BUILD, shard="50MB", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("small") / "qwen3", SMALL_BUILD, shard="40KB", tied=False, seed=3)


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 2])
def test_load_memory_shrinks_with_ranks(ray_session, law_dir, world):
    """Each rank's RSS growth while loading is at most its shard of the fp32 weights plus 64 MB."""
    p_mb = fp32_bytes(law_dir) / 2**20
    actor = fsdp(make_config(world, path=str(law_dir), dtype="bfloat16"))
    try:
        growth = actor.group.call("load_growth_mb")
    finally:
        actor.close()
    bound = p_mb / world + MARGIN_MB
    print(f"P = {p_mb:.0f} MB, {world} ranks: load growth per rank {[round(g) for g in growth]} MB, bound {bound:.0f}")
    assert max(growth) <= bound, (growth, bound)


def _assert_same(state: dict, ref: torch.nn.Module) -> None:
    want = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    assert set(state) == set(want), set(state) ^ set(want)
    for name, t in want.items():
        assert state[name].dtype == t.dtype and torch.equal(state[name], t.detach()), name


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharded_load_equals_full_load(ray_session, small_dir, world):
    """A pretrained multi-file directory (untied lm_head) and a seeded model.build, each loaded sharded,
    gathered whole: bit for bit the old full load."""
    from transformers import AutoModelForCausalLM

    for model in ({"path": str(small_dir)}, {"build": SMALL_BUILD}):
        config = make_config(world, **model)
        actor = fsdp(config)
        try:
            state = actor.group.call("full_state")[0]
        finally:
            actor.close()
        if "path" in model:
            ref = AutoModelForCausalLM.from_pretrained(str(small_dir), dtype=torch.float32).float()
        else:
            ref = Qwen3Adapter().build_model(config).float()
        _assert_same(state, ref)


@pytest.mark.slow
def test_export_is_multi_file_and_loads_in_transformers(ray_session, small_dir, tmp_path):
    """``export_hf`` after a training step: several files of about ``bucket_mb`` with an index that names
    every tensor; ``from_pretrained`` gives the trained weights bit for bit."""
    from transformers import AutoModelForCausalLM

    from unirl.api import Sample

    config = make_config(2, {"bucket_mb": 0.05}, path=str(small_dir))  # ~50 KB files: several
    actor = fsdp(config)
    try:
        actor.sft_step([Sample(id=f"a{i}/0", prompt_ids=[5, 6, 7 + i], response_ids=[8, 9], loss_mask=[1, 1],
                               status="ok") for i in range(2)])  # one per rank
        trained = actor.group.call("full_state")[0]
        actor.export_hf(str(tmp_path / "hf"))
    finally:
        actor.close()
    out = tmp_path / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files == sorted(p.name for p in out.glob("model-*.safetensors")), files
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    got = dict(model.named_parameters())
    assert set(got) == {n for n in trained if n in got} and len(got) == len(dict(model.named_parameters()))
    assert any(not torch.equal(trained[n], p) for n, p in  # the step changed weights: the export carries them
               AutoModelForCausalLM.from_pretrained(str(small_dir), dtype=torch.float32).named_parameters())
    for name, p in got.items():
        assert torch.equal(p.detach(), trained[name]), name


@pytest.mark.slow
def test_lora_base_from_path_loads_sharded_like_the_whole_build(ray_session, small_dir):
    """With ``actor.lora`` and a pretrained directory, each rank reads its base rows and the seeded
    adapter is drawn on a memory-free twin: base, adapter and the base fingerprint equal the old whole
    build's (``apply_lora`` on the loaded model, same seed) bit for bit."""
    from unirl.api import apply_lora, base_fingerprint

    config = make_config(2, lora={"r": 4, "alpha": 8}, path=str(small_dir))
    actor = fsdp(config)
    try:
        state = actor.group.call("full_state")[0]
        lora_base = actor.lora_base
    finally:
        actor.close()
    ref = apply_lora(Qwen3Adapter().build_model(config).float(), config.actor.lora, base_path=config.model.path,
                     seed=config.run.seed)
    _assert_same(state, ref)
    assert any(".lora_A." in n and state[n].abs().sum() > 0 for n in state)  # a drawn adapter, not zeros
    assert lora_base == base_fingerprint(ref)


@pytest.mark.slow
def test_moe_checkpoint_with_per_expert_names_loads_through_rank0(ray_session, tmp_path):
    """A Qwen3-MoE directory holds each expert under its own name while transformers 5 fuses them in
    memory: the names do not match, so rank 0 loads it whole and broadcasts; the result is still the
    old load's, bit for bit."""
    from unirl.models.qwen3_moe import Qwen3MoeAdapter

    adapter = Qwen3MoeAdapter()
    build = RunConfig.model_validate({"model": {"adapter": "qwen3_moe", "build": SMALL_BUILD}})
    torch.manual_seed(5)
    adapter.build_model(build).float().save_pretrained(str(tmp_path))
    build_demo_tokenizer().save_pretrained(str(tmp_path))
    config = make_config(2, adapter="qwen3_moe", path=str(tmp_path))
    actor = fsdp(config, adapter)
    try:
        state = actor.group.call("full_state")[0]
    finally:
        actor.close()
    ref = adapter.build_model(config).float()
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in state)
    _assert_same(state, ref)
