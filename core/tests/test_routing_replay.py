"""Rollout Routing Replay (R3, ``algorithm.routing_replay``) on the embedded engine and actor.

Oracles: the replayed gate against a hand-written MoE layer (softmax over the recorded experts, each
expert's SwiGLU by hand from the raw weights), output and gradients; the trainer's expert choices
read by a second hook against the engine's records; the agreement against a count made by hand from
the trainer's own top-k."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from unirl.config import RunConfig
from unirl.contracts import SamplingParams
from unirl.kernel.errors import ConfigError
from unirl.models.qwen3 import Qwen3Adapter
from unirl.models.qwen3_moe import Qwen3MoeAdapter
from unirl.models.tokenizer import build_demo_tokenizer
from unirl.packing import pack
from unirl.routing import NO_EXPERT, RouteReplay, RouterSpec, attach_routes, replay_for, routes_of
from unirl.samples import Sample
from unirl.testing import build_actor, build_engine


def _block(seed: int = 0, normalize: bool = True) -> Qwen3MoeSparseMoeBlock:
    cfg = Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4, num_experts_per_tok=2,
                         norm_topk_prob=normalize)
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(cfg).double()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return block


def _by_hand(block, x, experts, normalize: bool):
    """The layer's output with token t sent to ``experts[t]``: w = softmax(x Wr^T)[experts], renormalised,
    times each expert's down(silu(gate x) * up x), written from the raw weights."""
    logits = x @ block.gate.weight.T
    p = torch.exp(logits - logits.logsumexp(-1, keepdim=True))
    out = []
    for t in range(x.shape[0]):
        w = torch.stack([p[t, e] for e in experts[t]])
        if normalize:
            w = w / w.sum()
        y = 0
        for wi, e in zip(w, experts[t], strict=True):
            gu = block.experts.gate_up_proj[e] @ x[t]
            g, u = gu[: gu.shape[0] // 2], gu[gu.shape[0] // 2 :]
            y = y + wi * (block.experts.down_proj[e] @ (torch.nn.functional.silu(g) * u))
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("normalize", [True, False])
def test_replayed_gate_equals_hand_derived_output_and_gradient(normalize):
    block = _block(normalize=normalize)
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    own = block.gate(x)[2]
    # recorded experts: tokens 0-2 routed elsewhere than the trainer's own choice, token 3 its own, token 4 none
    rec = [[(int(own[t, 0]) + 1) % 4, (int(own[t, 1]) + 1) % 4] for t in range(3)]
    rec = [r if r[0] != r[1] else [r[0], (r[0] + 1) % 4] for r in rec]
    rec += [own[3].tolist(), [NO_EXPERT, NO_EXPERT]]
    replay = RouteReplay([RouterSpec(block.gate, 0, 2, 4, normalize)])
    replay.plan = torch.tensor(rec, dtype=torch.long)[:, None, :]
    got = block(x[None])[0]
    want_experts = rec[:4] + [own[4].tolist()]  # no record: the trainer's router
    want = _by_hand(block, x, want_experts, normalize)
    # the router's softmax runs in fp32 (transformers' and the replay's): 1e-7-relative from the fp64 oracle
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert any(sorted(r) != sorted(o) for r, o in zip(rec[:3], own[:3].tolist(), strict=True))  # a real re-route
    g_got = torch.autograd.grad(got.square().sum(), [block.gate.weight, block.experts.gate_up_proj])
    g_want = torch.autograd.grad(want.square().sum(), [block.gate.weight, block.experts.gate_up_proj])
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert g_got[0].abs().sum() > 0  # the router trains through the replayed experts
    overall, per = replay.agreement()  # 1 of the 4 recorded tokens (token 3) agreed before replay
    assert overall == pytest.approx(0.25) and per == [pytest.approx(0.25)]
    replay.close()


def test_routes_align_with_the_response_across_turns():
    s = Sample(id="p0", prompt_ids=[1, 2])
    s.append_model_turn([5, 6], [-0.1, -0.2], 0, "stop")
    first = np.arange(8, dtype=np.int16).reshape(2, 2, 2)
    attach_routes(s, first)
    s.append_part(type(s.parts[-1])("observation", [7, 7, 7], None, -1, turn=0))
    s.append_model_turn([9], [-0.3], 0, "stop")
    attach_routes(s, np.full((1, 2, 2), 3, dtype=np.int16))
    r = routes_of(s)
    assert r.shape == (6, 2, 2) and r.dtype == np.int16
    assert (r[:2] == first).all() and (r[2:5] == NO_EXPERT).all() and (r[5] == 3).all()


def _config(**algorithm) -> RunConfig:
    return RunConfig.model_validate({"model": {"adapter": "qwen3_moe"}, "rollout": {"max_new_tokens": 12},
                                     "algorithm": {"routing_replay": True, **algorithm}})


def test_dense_model_is_refused_by_preflight_in_one_line(tmp_path, capsys):
    from pathlib import Path

    from unirl import cli

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "arith-tiny.yaml"
    code = cli.main(["train", str(recipe), f"run.output_dir={tmp_path}", "algorithm.routing_replay=true"])
    text = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in text and len(text.splitlines()) == 1, text
    assert "algorithm.routing_replay" in text and "no experts" in text and "qwen3_moe" in text


def test_an_engine_that_records_nothing_is_refused_by_preflight(tmp_path, capsys):
    """SGLang declares no routing record (``EngineCapabilities.routing_record``): R3 is refused before a
    model is built, naming the field, instead of failing at the first replay."""
    from pathlib import Path

    from unirl import cli

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "arith-tiny-sglang.yaml"
    code = cli.main(["train", str(recipe), f"run.output_dir={tmp_path}", "model.adapter=qwen3_moe",
                     "algorithm.routing_replay=true"])
    text = capsys.readouterr().err
    assert code == 2 and "Traceback" not in text, text
    assert "algorithm.routing_replay" in text and "rollout.engine 'sglang' does not record" in text, text


def test_dense_model_is_refused_by_the_engine_naming_the_field():
    config = RunConfig.model_validate({"algorithm": {"routing_replay": True}})
    with pytest.raises(ConfigError, match=r"algorithm\.routing_replay.*qwen3_moe") as err:
        build_engine(config, adapter=Qwen3Adapter(), tokenizer=build_demo_tokenizer())
    assert "\n" not in str(err.value)


def _trainer_choices(actor, samples):
    """The trainer's expert ids at every packed position, per layer, as its replay forward routes them."""
    seen = []
    hooks = [r.module.register_forward_hook(lambda m, a, out: seen.append(out[2].clone()))
             for r in Qwen3MoeAdapter().routers(actor.model)]
    try:
        actor.logprobs(samples)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_trainer_routes_response_tokens_to_the_recorded_experts(caplog):
    """A bf16 engine against the fp32 trainer: some routing differs before replay (the agreement says
    how much), and with the replay every response token's trainer experts equal the record exactly."""
    tok = build_demo_tokenizer()
    config = _config()
    adapter = Qwen3MoeAdapter()
    actor = build_actor(config, adapter=adapter, tokenizer=tok)
    engine = build_engine(config.model_copy(update={"rollout": config.rollout.model_copy(
        update={"options": {"dtype": "bfloat16"}})}), adapter=adapter, tokenizer=tok, model=actor.model)
    prompts = ["Q: 1+2=? A:", "Q: 12+7=? A:", "Q: 3-15=? A:", "Q: 19*19=? A:"]
    samples = [Sample(id=f"p{i}/0", prompt_ids=tok.encode(p), seed=7 + i) for i, p in enumerate(prompts)]
    samples = engine.generate(samples, SamplingParams(max_new_tokens=12, temperature=1.0))
    for s in samples:
        r = s.routing
        assert r.shape == (len(s.response_ids), 2, 2) and r.dtype == np.int16
        assert (r[:-1] >= 0).all() and (r[:-1] < 8).all() and (r[-1] == NO_EXPERT).all()  # last token: not fed
    replay = replay_for(actor.model)
    assert replay is not None
    seen = _trainer_choices(actor, samples)
    measured, per_layer = replay.agreement()
    starts = pack(samples).cu_seqlens.tolist()
    for layer, ids in enumerate(seen):
        for s, start in zip(samples, starts, strict=False):
            at, n = start + len(s.prompt_ids), len(s.response_ids) - 1
            rec = torch.from_numpy(s.routing[:n, layer].astype(np.int64))
            assert torch.equal(ids[at : at + n], rec), (s.id, layer)  # replayed exactly
    # the agreement before replay, by hand: the trainer's own top-k sets with the replay's hooks off
    agree = total = 0
    by_layer = []
    for layer, ids in enumerate(_trainer_choices_no_replay(actor, samples, replay)):
        a = t = 0
        for s, start in zip(samples, starts, strict=False):
            at, n = start + len(s.prompt_ids), len(s.response_ids) - 1
            rec = torch.from_numpy(s.routing[:n, layer].astype(np.int64)).sort(-1).values
            a += int((ids[at : at + n].sort(-1).values == rec).all(-1).sum())
            t += n
        by_layer.append(a / t)
        agree, total = agree + a, total + t
    print(f"routing agreement before replay (bf16 engine, fp32 trainer): {agree / total:.4f}, per layer "
          f"{per_layer}")
    assert measured == pytest.approx(agree / total)
    assert agree < total  # the engine routed some token elsewhere: the exact match above is the replay's doing
    batch = {"advantages": [torch.ones(len(s.response_ids)) for s in samples]}
    with caplog.at_level(logging.DEBUG, logger="unirl.routing"):
        metrics = actor.train_step(samples, batch)
    assert metrics["routing/agreement"] == pytest.approx(agree / total)  # one micro-batch: its share is 1
    # per layer in the debug output: "layer:share" for each sparse layer, the shares the hand count gives
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("routing agreement per layer")]
    assert lines, "no per-layer agreement in the debug log"
    logged = dict(p.split(":") for p in lines[-1].split(": ", 1)[1].split())
    assert [float(logged[str(r.layer)]) for r in replay.routers] == pytest.approx(by_layer, abs=1e-4)


def _trainer_choices_no_replay(actor, samples, replay):
    """The trainer's own choices: the replay's hooks removed for one forward, then put back."""
    handles, replay._handles = replay._handles, []
    for h in handles:
        h.remove()
    try:
        return _trainer_choices(actor, samples)
    finally:
        replay._handles = [r.module.register_forward_hook(replay._hook(i, r)) for i, r in enumerate(replay.routers)]
