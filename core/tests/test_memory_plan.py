"""The memory plan (issue 67): the arithmetic against independent counts, `unirl plan` builds no model,
preflight refuses a layout that cannot fit and names fixes that, applied, make it fit (one test per fix),
and the 30B-A3B GPU recipe as it stood before the memory issue is refused while the fixed one fits."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch
import transformers

from unirl.cli import main
from unirl.config import load_config
from unirl.kernel.manager import load_kernel
from unirl.memory_plan.check import memory_violations, unirl_preflight
from unirl.memory_plan.facts import facts_of
from unirl.memory_plan.plan import GB, plan, with_override

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"

#: Qwen3-30B-A3B's architecture (its config.json at revision ad44e777, the fields the plan reads)
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                     hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                     max_position_embeddings=40960, torch_dtype="bfloat16")

#: the recipe as it stood before the memory issue (commit cc91b5e~1): no cpu_offload
OLD_30B = """
extends: {root}/recipes/parity-moe-tiny-bf16-tp2.yaml
run: {{name: parity-qwen3-30b-a3b-fsdp4-tp4}}
model: {{adapter: qwen3_moe, path: {model}, tokenizer: {model}, dtype: bfloat16}}
rollout:
  n: 4
  max_new_tokens: 32
  options: {{tensor_parallel_size: 4, gpu_memory_utilization: 0.35, allow_bf16_cpu: false,
            engine_args: {{attention_backend: FLASH_ATTN, enable_expert_parallel: false}}}}
actor:
  micro_batch_size: 4
  options: {{world_size: 4, device: cuda, backend: nccl}}
trainer: {{steps: 2, prompts_per_step: 8}}
"""


#: a 25 M-parameter Qwen3 (model.build): big enough for each fix to matter
BIG = ("model.build={hidden_size: 512, intermediate_size: 1536, num_hidden_layers: 8, num_attention_heads: 8, "
       "num_key_value_heads: 4, head_dim: 64}")


@pytest.fixture(scope="module")
def kernel():
    return load_kernel()


def _adapter(kernel, config):
    return kernel.get("model_adapters", config.model.adapter).load()()


def test_params_match_transformers() -> None:
    """The parameter count from the config alone equals the built model's, dense (tied) and MoE (untied)."""
    dense = transformers.Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     tie_word_embeddings=True)
    moe = transformers.Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=False)
    for hf, cls in ((dense, transformers.Qwen3ForCausalLM), (moe, transformers.Qwen3MoeForCausalLM)):
        model = cls(hf)
        assert facts_of(hf.to_dict()).params == sum(p.numel() for p in model.parameters())


def test_chunk_bytes_follow_the_actor() -> None:
    from unirl.actor.chunked_logprobs import CHUNK_BYTES
    from unirl.memory_plan.arithmetic import CHUNK_BYTES as planned

    assert planned == CHUNK_BYTES


def test_plan_command_builds_no_module(monkeypatch, capsys) -> None:
    """`unirl plan` prints each device's items, total, budget and headroom, and constructs no nn.Module."""
    built = []
    original = torch.nn.Module.__init__

    def counting(self, *args, **kwargs):
        built.append(type(self).__name__)
        original(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__init__", counting)
    assert main(["plan", str(RECIPES / "arith-tiny-fsdp.yaml"), "run.memory_budget_gb=4"]) == 0
    out = capsys.readouterr().out
    assert built == []
    for what in ("rank 0 (host)", "rank 1 (host)", "parameters (fp32)", "AdamW moments", "activations",
                 "engine", "budget 4.00 GiB", "headroom"):
        assert what in out, what


@pytest.mark.parametrize("overrides", [[], ["model.adapter=qwen3_moe"], [BIG]])
def test_architecture_is_hf_config(overrides, tmp_path, kernel) -> None:
    """The plan's plain-data facts (ModelAdapter.architecture: no transformers) equal the transformers
    config's, for the tiny dense and MoE builds, a sized build, and a model.path's config.json."""
    config = load_config(RECIPES / "arith-tiny.yaml", overrides)
    adapter = _adapter(kernel, config)
    assert facts_of(adapter.architecture(config)) == facts_of(adapter.hf_config(config).to_dict())
    saved = tmp_path / "m"
    adapter.hf_config(config).save_pretrained(saved)
    loaded = load_config(RECIPES / "arith-tiny.yaml", [*overrides, f"model.path={saved}"])
    assert facts_of(adapter.architecture(loaded)) == facts_of(adapter.hf_config(config).to_dict())


@pytest.mark.parametrize("recipe", ["arith-tiny", "arith-tiny-fsdp", "arith-tiny-vllm-fsdp"])
def test_plan_path_imports_no_torch(recipe) -> None:
    """`unirl plan` in a fresh interpreter imports neither torch (the actors' light declarations,
    ``unirl_declarations``) nor transformers, vLLM or Ray, so it can construct no torch.nn.Module; the
    embedded actor, the FSDP actor and vLLM. Prints the wall time (no timed assertion:
    benchmarks/memory_plan.py --plan-time)."""
    import subprocess
    import sys
    import time

    code = ("import sys; from unirl.cli import main; main(['plan', sys.argv[1]]); "
            "print('IMPORTED', sorted(m for m in ('torch', 'transformers', 'vllm', 'ray') if m in sys.modules))")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, str(RECIPES / f"{recipe}.yaml")], capture_output=True,
                         text=True, check=True).stdout
    print(f"unirl plan {recipe}: {time.perf_counter() - t0:.2f} s wall")
    assert "parameters (fp32)" in out
    assert "IMPORTED []" in out


def test_declarations_are_the_components_bases(kernel) -> None:
    """Each registered light declaration is a base of its component's class (they cannot disagree), carries
    the class's Config, capabilities and memory layout, and a declaration the class does not inherit is
    refused by name."""
    from types import SimpleNamespace

    from unirl.kernel.errors import PluginError

    declared = kernel.registries["declarations"]
    assert {"actors.torch", "actors.fsdp"} <= set(declared)
    for key in declared:
        kind, name = key.split(".", 1)
        light, cls = kernel.declaration(kind, name), kernel.get(kind, name).load()
        assert issubclass(cls, light) and light is not cls
        below = cls.__mro__[:cls.__mro__.index(light)]  # nothing between the class and its declaration overrides
        for attr in ("Config", "capabilities", "memory_layout"):
            assert attr in vars(light) and not any(attr in vars(k) for k in below), (key, attr)
    wrong = SimpleNamespace(unirl_declarations=lambda: {"actors.torch": "unirl.actor.declaration:TorchActorOptions"})
    other = load_kernel(discover=False, extra=[("core-only", __import__("unirl.builtins").builtins)])
    other.registries["declarations"] = load_kernel(discover=False, extra=[("wrong", wrong)]).registries["declarations"]
    other.get("actors", "torch").load()
    with pytest.raises(PluginError, match="is not a base class of the component"):
        other.declaration("actors", "torch")


def _model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "qwen3-30b-a3b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    return d


def test_30b_a3b_old_recipe_refused_fixed_recipe_fits(tmp_path, kernel) -> None:
    """On paper (recipe header): 30.5 B x 16 B / 4 ranks = 122 GB of fp32 state a GPU, over an 80 GB card;
    with cpu_offload the GPU holds the working set and vLLM's 0.35 x 80 GB."""
    model = _model_dir(tmp_path)
    old = tmp_path / "old.yaml"
    old.write_text(OLD_30B.format(root=ROOT, model=model))
    config = load_config(old, ["run.memory_budget_gb=80"])
    p = plan(config, kernel, _adapter(kernel, config))
    gpu0 = next(d for d in p.devices if d.device == "gpu:0")
    state = sum(i.bytes for _, i in gpu0.items if "fp32" in i.name)
    assert state == pytest.approx(30.53e9 * 16 / 4, rel=0.01)  # the header's 122 GB
    found = memory_violations(config, kernel, _adapter(kernel, config))
    assert [v.message.split(": predicted")[0] for v in found] == ["gpu:0, gpu:1, gpu:2, gpu:3 (each)"]
    assert "actor.options.cpu_offload=true" in found[0].fix and "fits" in found[0].fix
    fixed = load_config(RECIPES / "gpu" / "parity-qwen3-30b-a3b-fsdp4-tp4.yaml",
                        [f"model.path={model}", f"model.tokenizer={model}", "run.memory_budget_gb=80"])
    assert memory_violations(fixed, kernel, _adapter(kernel, fixed)) == []
    after = plan(fixed, kernel, _adapter(kernel, fixed))
    assert 30 * GB < next(d for d in after.devices if d.device == "gpu:0").total < 45 * GB


def _total(config, kernel) -> int:
    p = plan(config, kernel, _adapter(kernel, config))
    return max([d.total for d in p.devices if d.kind == "gpu"] or [p.host_total])


def _named(fix_text: str, field: str) -> str:
    m = re.search(rf"{re.escape(field)}=(.+?) \(", fix_text)
    assert m, f"{field} not named in: {fix_text}"
    return m.group(1)


#: (recipe, overrides, the fix's field): each refusal path, with a model big enough for the fix to matter
PATHS = [
    ("arith-tiny.yaml", [BIG, "actor.micro_batch_size=128"], "actor.activation_checkpointing"),
    ("arith-tiny.yaml", [BIG, "actor.micro_batch_size=128"], "actor.micro_batch_size"),
    ("arith-tiny.yaml", [BIG, "actor.micro_batch_size=1"], "actor.lora"),
    ("arith-tiny-fsdp.yaml", [BIG, "actor.micro_batch_size=1", "actor.options.device=cuda"], "actor.options.world_size"),
    ("arith-tiny-fsdp.yaml", [BIG, "actor.micro_batch_size=1", "actor.options.device=cuda"], "actor.options.cpu_offload"),
    ("arith-tiny-fsdp.yaml", [BIG, "actor.micro_batch_size=16", "actor.options.device=cuda",
                              "actor.options.reshard_after_forward=false"], "actor.options.reshard_after_forward"),
]


@pytest.mark.parametrize(("recipe", "overrides", "field"), PATHS, ids=[p[2] for p in PATHS])
def test_each_named_fix_applied_fits(recipe, overrides, field, kernel) -> None:
    """A budget between the layout's peak and the peak with the fix: refused, the fix is named with its
    effect, and the config with the named value applied passes the check."""
    from unirl.memory_plan.fixes import candidates

    base = load_config(RECIPES / recipe, overrides)
    adapter = _adapter(kernel, base)
    before = _total(base, kernel)
    fix = next(f for f in candidates(base, list(plan(base, kernel, adapter).fixes)) if f.field == field)
    after = _total(with_override(base, field, fix.value), kernel)
    assert after < before
    budget = (before + after) / 2 / GB
    config = load_config(RECIPES / recipe, [*overrides, f"run.memory_budget_gb={budget}"])
    found = memory_violations(config, kernel, adapter)
    assert found, "the layout should be over its budget"
    value = _named(found[0].fix, field)
    assert "predicted peak" in found[0].message and "largest:" in found[0].message
    fixed = load_config(RECIPES / recipe, [*overrides, f"run.memory_budget_gb={budget}", f"{field}={value}"])
    assert memory_violations(fixed, kernel, adapter) == []


def test_vllm_reservation_fix_applied_fits(kernel) -> None:
    """vLLM's declared fix (a smaller gpu_memory_utilization): its reservation is a share of the budget
    itself, so the budget is fixed here (10 GiB) and the share set so that the card is over with it and
    fits at half of it; the named value, applied, passes."""
    over = [BIG, "actor.options={device: cuda, world_size: 1}", "rollout.options.gpu_memory_utilization=0.96",
            "rollout.options.tensor_parallel_size=1", "run.memory_budget_gb=10"]
    config = load_config(RECIPES / "arith-tiny-vllm-fsdp.yaml", over)
    adapter = _adapter(kernel, config)
    found = memory_violations(config, kernel, adapter)
    assert found and found[0].message.startswith("gpu:0")
    value = _named(found[0].fix, "rollout.options.gpu_memory_utilization")
    assert float(value) == pytest.approx(0.48)
    fixed = load_config(RECIPES / "arith-tiny-vllm-fsdp.yaml",
                        [*over, f"rollout.options.gpu_memory_utilization={value}"])
    assert memory_violations(fixed, kernel, adapter) == []


def test_memory_check_modes(kernel, capsys) -> None:
    """error refuses through preflight's hook; warn prints and passes; off skips."""
    over = [BIG, "run.memory_budget_gb=0.01"]
    config = load_config(RECIPES / "arith-tiny.yaml", over)
    adapter = _adapter(kernel, config)
    assert unirl_preflight(config=config, adapter=adapter, kernel=kernel)
    warn = load_config(RECIPES / "arith-tiny.yaml", [*over, "run.memory_check=warn"])
    assert unirl_preflight(config=warn, adapter=adapter, kernel=kernel) == []
    assert "memory plan: " in capsys.readouterr().err
    off = load_config(RECIPES / "arith-tiny.yaml", [*over, "run.memory_check=off"])
    assert unirl_preflight(config=off, adapter=adapter, kernel=kernel) == []


def test_preflight_refuses_before_anything_starts(kernel) -> None:
    """Through preflight's one report (what `unirl train` runs before Ray or a model): the host is named,
    with predicted and available bytes, and the command exits 2."""
    from unirl.kernel.errors import PreflightError
    from unirl.preflight import check

    config = load_config(RECIPES / "arith-tiny.yaml", [BIG, "run.memory_budget_gb=0.01"])
    with pytest.raises(PreflightError) as err:
        check(config, kernel)
    text = str(err.value)
    assert "run.memory_check" in text and "host: predicted peak" in text and "exceeds the 10.2 MiB" in text
    assert main(["preflight", str(RECIPES / "arith-tiny.yaml"), BIG, "run.memory_budget_gb=0.01"]) == 2


@pytest.mark.parametrize(("recipe", "device", "item", "size"), [
    ("arith-tiny-vllm.yaml", "engine worker 0", "KV cache", 1 * GB),  # VLLM_CPU_KVCACHE_SPACE's 1 GiB
    ("arith-tiny-vllm.yaml", "trainer", "sync staging (2 buckets)", 2 * 256 * 2**20),  # bucket_mb 256
    ("arith-tiny-sglang.yaml", "sglang server 0", "engine weights (float32)", None),
])
def test_engines_declare_their_memory(recipe, device, item, size, kernel) -> None:
    """vLLM and SGLang declare their items (the plugins' memory_layout modules), colocated ones add up."""
    config = load_config(RECIPES / recipe)
    p = plan(config, kernel, _adapter(kernel, config))
    dev = next(d for d in p.devices if d.device == device)
    got = next(i for _, i in dev.items if i.name == item)
    if size is not None:
        assert got.bytes == size
    else:  # an external server: shown with the model's weights, never checked against this host
        assert dev.kind == "external" and got.bytes == 4 * facts_of(_adapter(kernel, config).hf_config(config).to_dict()).params
    assert p.undeclared == []


#: one 12.6 M-parameter layer (a 250 M Qwen3's): its flat fp32 reduce-scatter input (50 MB) is mmapped
WIDE = ("model.build={hidden_size: 1024, intermediate_size: 3072, num_hidden_layers: 2, num_attention_heads: 16, "
        "num_key_value_heads: 8, head_dim: 64}")


@functools.cache
def _layer_sizes(build: str) -> tuple[int, list[int]]:
    """(decoder layers, parameter count of each tensor of one layer) of the model torch builds."""
    config = load_config(RECIPES / "arith-tiny-fsdp.yaml", [build])
    layers = _adapter(load_kernel(), config).build_model(config).model.layers
    return len(layers), [p.numel() for p in layers[0].parameters()]


@pytest.mark.parametrize("build", [BIG, WIDE], ids=["25M", "wide-layer"])
@pytest.mark.parametrize(("ranks", "dtype"), [(1, "float32"), (1, "bfloat16"), (2, "float32"), (4, "float32"),
                                              (2, "bfloat16"), (4, "bfloat16")])
def test_fsdp_cpu_heap_term(build, ranks, dtype, kernel) -> None:
    """The FSDP CPU rank's backward heap term (arithmetic.heap_backward_bytes' derivation), against the
    built model's own decoder-layer tensors (torch's count, not the plan's): per layer, the compute-dtype
    gradients at one rank, fp32 gradients + the flat fp32 reduce-scatter input at several ranks in fp32, the
    input alone in bf16; when that input is 32 MiB or more (mmapped by glibc), only bf16 gradients at several
    ranks (the fitted 250 M rule); every rank the same."""
    opts = (f"actor.options={{world_size: {ranks}, cpus_per_rank: 0.5, compute_dtype: {dtype}, device: cpu}}")
    config = load_config(RECIPES / "arith-tiny-fsdp.yaml", [build, opts])
    adapter = _adapter(kernel, config)
    n_layers, sizes = _layer_sizes(build)
    cb, big = {"float32": 4, "bfloat16": 2}[dtype], 32 * 2**20
    heap_resident = 4 * sum(sizes) < big  # the layer's flat fp32 reduce-scatter input
    counted = (ranks == 1 or cb == 4) if heap_resident else (ranks > 1 and cb == 2)  # whose gradients strand
    grads = cb * sum(sizes) if counted else 0
    flat = 4 * sum(sizes) if heap_resident and ranks > 1 else 0
    p = plan(config, kernel, adapter)
    heaps = [i.bytes for d in p.devices if d.device.startswith("rank") for _, i in d.items
             if i.name == "backward blocks the heap keeps"]
    expected = n_layers * (grads + flat)
    assert heaps == ([expected] * ranks if expected else [])  # nothing kept: no item
    assert (expected > 0) == (build == BIG or (ranks > 1 and cb == 2))
