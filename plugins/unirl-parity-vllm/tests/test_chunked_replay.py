"""Under parity, the actor's chunked log-probs (core's ``unirl.actor.chunked_logprobs``: the output
projection one chunk of tokens at a time, for large vocabularies) keep every bit: the embedded engine's
decode equals the chunked replay, and the chunked replay equals the direct one in fp32 and in bf16, with
an odd number of tokens (a plain bf16 GEMM gave one row other bits there at Qwen3's vocabulary; the
provider's linear is row-invariant by construction)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: the helpers beside this file
from test_providers import VOCAB, _Tok, config, samples, tiny_model  # noqa: E402

from unirl.actor import chunked_logprobs  # noqa: E402
from unirl.api import Qwen3Adapter, RunConfig, Sample, SamplingParams, build_engine, default_runtime  # noqa: E402
from unirl.packing import pack  # noqa: E402
from unirl_parity_vllm.providers import Qwen3ParityProvider  # noqa: E402

ROWS = chunked_logprobs.ROW_ALIGN


def chunked(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(chunked_logprobs, "CHUNK_BYTES", ROWS * 4 * VOCAB if on else 10**12)


def replay(model, batch):
    with torch.no_grad():
        return chunked_logprobs.forward_logprobs(model, pack(batch))[0]


def test_embedded_engine_decode_equals_chunked_replay(monkeypatch):
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    cfg = RunConfig.model_validate({"plugins": {"parity": {"enabled": True}}, "rollout": {"max_new_tokens": 40}})
    rt = default_runtime(cfg, adapter=Qwen3Adapter())
    model = tiny_model()
    engine = build_engine(cfg, adapter=Qwen3Adapter(), model=model, runtime=rt, tokenizer=_Tok())
    batch = [Sample(id=f"p{i}/0", prompt_ids=s.prompt_ids, seed=i) for i, s in enumerate(samples(12, seed=3))]
    engine.generate(batch, SamplingParams(max_new_tokens=40, temperature=1.0))
    rollout = torch.tensor([x for s in batch for x in s.rollout_logprobs])
    assert len(chunked_logprobs.chunk_bounds(rollout.numel(), VOCAB, ROWS * 4 * VOCAB)) >= 4
    chunked(monkeypatch, True)
    with rt.exact("replay"):
        got = replay(model, batch)
    assert torch.equal(got, rollout), f"{int((got != rollout).sum())} of {rollout.numel()} differ"


def test_chunked_equals_direct_in_fp32_and_bf16(monkeypatch):
    prov = Qwen3ParityProvider(config=config())
    batch = samples(11)  # an odd number of target tokens
    n = sum(len(s.response_ids) for s in batch)
    assert n % 2 == 1 and len(chunked_logprobs.chunk_bounds(n, VOCAB, ROWS * 4 * VOCAB)) >= 3
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model().to(dtype)
        with prov.exact_context("replay"):
            chunked(monkeypatch, False)
            direct = replay(model, batch)
            chunked(monkeypatch, True)
            assert torch.equal(replay(model, batch), direct), dtype
