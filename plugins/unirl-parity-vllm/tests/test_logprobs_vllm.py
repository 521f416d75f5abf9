"""The processed log-probs' mask (core's ``unirl.logprobs.apply_top_k_top_p``, which the vLLM side installs
in place of vLLM's) against vLLM's own PyTorch implementation, bit for bit: random rows, rows with ties,
top-k only, top-p only, both, per-row k and p. No engine: vLLM is imported, not started."""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # importing vLLM: 59 s at load ~8 on 2 cores


def test_the_mask_is_vllms_bit_for_bit():
    if os.environ.get("CI") != "true":
        pytest.importorskip("vllm")
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from unirl_parity_vllm import ops

    g = torch.Generator().manual_seed(0)
    cases = 0
    for trial in range(60):
        b, v = 7, int(torch.randint(5, 300, (1,), generator=g))
        x = torch.randn(b, v, generator=g) * 3
        if trial % 3 == 0:
            x = torch.round(x)  # many ties, at the top-k boundary and inside top-p's sort
        k = torch.randint(1, v + 1, (b,), generator=g, dtype=torch.int32)
        p = torch.rand(b, generator=g) * 0.99 + 0.01
        for kk, pp in ((k, p), (k, None), (None, p)):
            want = apply_top_k_top_p_pytorch(x.clone(), kk, pp, allow_cpu_sync=True)
            got = ops.apply_top_k_top_p(x.clone(), kk, pp)
            assert torch.equal(got, want), (trial, kk, pp)
            cases += 1
    assert cases == 180


def test_the_vllm_side_installs_it():
    """The replacement is a listed target with vLLM's exact signature (checked in phase 1 like every other)."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("vllm")
    from unirl_parity_vllm.vllm_side import kernels, symbols

    target = next(t for t in symbols.COMMON if t.key == "sampler.apply_top_k_top_p")
    assert target.params == ("logits", "k", "p") and target.replacement == "apply_top_k_top_p"
    assert symbols.check_target(target) == []
    assert "apply_top_k_top_p" in symbols.REQUIRED_OPS and callable(kernels.apply_top_k_top_p)
