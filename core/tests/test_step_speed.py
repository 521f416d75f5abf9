"""Issue 10 (GRPO step speed): per-sequence packed attention, the replay shortcut, ignore_eos / min_new_tokens.

Oracles: per-sample plain forwards (attention), the replayed pi_old (shortcut, bitwise), the raw model
logits (engine log-probs under min_new_tokens).
"""

from __future__ import annotations

import copy

import pytest
import torch

from unirl.actor.torch_actor import TorchActor
from unirl.config import RunConfig
from unirl.contracts import SamplingParams, StepInfo
from unirl.engine.torch_engine import TorchEngine
from unirl.models.qwen3 import Qwen3Adapter
from unirl.models.tokenizer import build_demo_tokenizer
from unirl.packing import PACKED_ATTENTION, _buckets, enable_packed_attention, pack
from unirl.samples import Sample
from unirl.testing import build_engine, default_runtime
from unirl.trainer.replay import old_logprobs_needed, replay_reasons

VOCAB = 64


def tiny_model(seed: int = 0):
    from transformers import Qwen3ForCausalLM

    cfg = Qwen3Adapter().hf_config(RunConfig(), vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).float()


def samples_of(lengths, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(lengths):
        mask = [1] * r
        if r > 3:
            mask[2] = 0
        out.append(Sample(id=f"p{i // 2}/{i % 2}", prompt_ids=torch.randint(2, VOCAB, (p,), generator=g).tolist(),
                          response_ids=torch.randint(2, VOCAB, (r,), generator=g).tolist(), loss_mask=mask))
    return out


LENGTHS = [(3, 5), (1, 1), (6, 9), (2, 7), (4, 3), (5, 0), (2, 11)]


def per_sample_logp(model, samples) -> torch.Tensor:
    """The oracle: one plain sdpa forward per sample, nothing packed."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    out = []
    with torch.no_grad():
        for s in samples:
            logits = ref(input_ids=torch.tensor([s.prompt_ids + s.response_ids]), use_cache=False).logits[0].float()
            P = len(s.prompt_ids)
            rows = torch.log_softmax(logits[P - 1: P - 1 + len(s.response_ids)], -1)
            out.append(rows.gather(-1, torch.tensor(s.response_ids, dtype=torch.long)[:, None])[:, 0])
    return torch.cat(out)


# ----------------------------------------------------------------------------- packed attention


def test_packed_attention_is_per_sequence_and_matches_per_sample(monkeypatch):
    """Packed log-probs equal the per-sample forwards to 1e-6, and sdpa only ever sees one sequence per
    batch row (``[n, H, L, D]`` per length bucket), never the whole packed row: the cost is linear in the
    sequences, and a short sequence is not padded to the longest of the batch."""
    from unirl.actor.skeleton import forward_logprobs

    model = tiny_model()
    assert enable_packed_attention(model) and model.config._attn_implementation == PACKED_ATTENTION
    samples = samples_of(LENGTHS)
    pb = pack(samples)
    shapes = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        shapes.append((tuple(q.shape), kw.get("attn_mask") is None, kw.get("is_causal")))
        return real_sdpa(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        logp, _, _ = forward_logprobs(model, pb)
    monkeypatch.undo()
    lens = [p + r for p, r in LENGTHS]
    buckets = [(len(g), 4, max(lens[i] for i in g), 32) for g in _buckets(lens)]  # rows of about one length
    assert len(buckets) > 1 and sum(b[0] for b in buckets) == len(LENGTHS)
    assert [s for s, *_ in shapes] == buckets * model.config.num_hidden_layers, shapes
    assert all(no_mask and causal for _, no_mask, causal in shapes), shapes
    torch.testing.assert_close(logp, per_sample_logp(model, samples), atol=1e-6, rtol=0)


@pytest.mark.parametrize("length", ["short", "long"])
def test_packed_attention_under_cpu_autocast(monkeypatch, length):
    """Under CPU bf16 autocast the packed attention hands sdpa fp32 q/k/v for short sequences (there the
    bf16 backward is 2.6x slower on the CPU) and bf16 ones for long sequences (there the bf16 kernel is the
    faster; ``long``: the threshold lowered so the test's sequences count as long), and returns
    autocast's dtype to the bf16 projections; gradients reach every weight, and the log-probs stay
    within bf16 rounding of the fp32 per-sample oracle. Without autocast sdpa sees the model's own dtype
    (the bitwise tests above)."""
    import unirl.packing
    from unirl.actor.skeleton import forward_logprobs
    from unirl.packing import packed_attention_forward

    if length == "long":
        monkeypatch.setattr(unirl.packing, "LOW_PRECISION_ATTENTION_MIN_LEN", 1)
    expected = (torch.float32 if length == "short" else torch.bfloat16,) * 3 + (False,)
    model = tiny_model()
    enable_packed_attention(model)
    samples = samples_of(LENGTHS)
    seen, outs = [], []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
        return real_sdpa(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, PACKED_ATTENTION,
                        lambda *a, **kw: outs.append(packed_attention_forward(*a, **kw)) or outs[-1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _, _ = forward_logprobs(model, pack(samples))
    logp.float().sum().backward()
    assert seen and all(d == expected for d in seen), seen
    assert outs and all(o.dtype == torch.bfloat16 for o, _ in outs), [o.dtype for o, _ in outs]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.model.layers[0].self_attn.parameters())
    assert logp.dtype == torch.float32
    err = (logp.detach() - per_sample_logp(model, samples)).abs().max().item()
    assert 0 < err < 0.1, err
    seen.clear()
    with torch.no_grad():  # no autocast: the model's own dtype, at every length
        forward_logprobs(model, pack(samples))
    assert seen and all(d == (torch.float32,) * 3 + (False,) for d in seen)


def test_packed_attention_invariant_to_batch_composition():
    """A sample's log-probs do not depend on what it is packed with (uniform-length fast path included)."""
    from unirl.actor.skeleton import forward_logprobs

    model = tiny_model()
    enable_packed_attention(model)
    samples = samples_of(LENGTHS)
    with torch.no_grad():
        alone = [forward_logprobs(model, pack([s]))[0] for s in samples]
        together = pack(samples).split(forward_logprobs(model, pack(samples))[0])
        uniform = samples_of([(4, 6)] * 4, seed=3)
        u_together = pack(uniform).split(forward_logprobs(model, pack(uniform))[0])
        u_alone = [forward_logprobs(model, pack([s]))[0] for s in uniform]
    worst = max((a - b).abs().max().item() for a, b in zip(alone + u_alone, together + u_together, strict=True)
                if a.numel())
    assert worst <= 1e-6, worst


def test_packed_attention_falls_back_for_generate_and_engine_copies():
    """With a padding mask or a KV cache the model on PACKED_ATTENTION still equals sdpa; an engine built
    from an actor's model gets sdpa back (its fast path checks the implementation name)."""
    model = tiny_model()
    ref = copy.deepcopy(model)
    enable_packed_attention(model)
    ids = torch.randint(2, VOCAB, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits
        b = ref(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], atol=1e-6, rtol=0)
    eng = TorchEngine(config=RunConfig(), runtime=default_runtime(RunConfig()), adapter=Qwen3Adapter(),
                      tokenizer=build_demo_tokenizer(), model=model)
    assert eng.model.config._attn_implementation == "sdpa" and eng.fast
    assert model.config._attn_implementation == PACKED_ATTENTION  # the actor's model is untouched


# ----------------------------------------------------------------------------- no redundant replay


def _actor(config: RunConfig) -> TorchActor:
    return TorchActor(config=config, runtime=default_runtime(config), adapter=Qwen3Adapter(), model=tiny_model())


@pytest.mark.parametrize("mbs", [3, 64], ids=["micro3", "one-micro"])
def test_train_step_without_old_logprobs_is_bitwise_the_replayed_step(mbs):
    """The shortcut: train_step with batch['old_logprobs'] = actor.logprobs(samples) and without it give
    bitwise equal losses, metrics, per-micro-batch log-probs and gradients (so weights after the step)."""
    config = RunConfig.model_validate({"actor": {"lr": 1e-3, "micro_batch_size": mbs},
                                       "algorithm": {"clip_high": 0.28}})
    samples = samples_of(LENGTHS)
    g = torch.Generator().manual_seed(1)
    adv = [torch.randn(len(s.response_ids), generator=g) for s in samples]
    runs = []
    for with_replay in (True, False):
        actor = _actor(config)
        seen, grads = [], []
        actor.set_before_backward(lambda ctx, seen=seen: seen.append(ctx.logprobs.clone()))
        orig = actor._clip_and_step

        def capture(opt, params, grads=grads, orig=orig):
            grads.extend(p.grad.detach().clone() for p in params)
            return orig(opt, params)

        actor._clip_and_step = capture
        batch = {"advantages": [a.clone() for a in adv]}
        if with_replay:
            batch["old_logprobs"] = actor.logprobs(samples)
        metrics = actor.train_step(samples, batch, StepInfo())
        runs.append((metrics, seen, grads, [p.detach().clone() for p in actor.model.parameters()]))
    (m1, s1, g1, w1), (m2, s2, g2, w2) = runs
    assert m1 == m2  # every metric, loss and grad_norm included, bit for bit
    assert m1["clip_frac"] == 0.0  # ratio exactly 1 in both
    assert len(s1) == len(s2) and all(torch.equal(a, b) for a, b in zip(s1, s2, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(w1, w2, strict=True))
    assert any(g.abs().sum() > 0 for g in g1)


def test_old_logprobs_needed_truth_table():
    def cfg(**alg):
        return RunConfig.model_validate({"algorithm": alg})

    assert not old_logprobs_needed(cfg())  # GRPO, one update per batch: the forward is pi_old
    assert not old_logprobs_needed(cfg(old_logp_source="rollout"))  # no replay at all
    assert not old_logprobs_needed(cfg(kl_coef=0.1))  # KL in the loss reads ref, not pi_old
    assert old_logprobs_needed(cfg(updates_per_batch=2))
    assert old_logprobs_needed(cfg(kl_coef=0.1, kl_form="reward"))
    assert old_logprobs_needed(cfg(modifiers=["rollout_correction"]))
    assert old_logprobs_needed(cfg(), modifiers=[lambda samples, batch, config: None])
    assert "updates_per_batch=2" in replay_reasons(cfg(updates_per_batch=2))[0]


# ----------------------------------------------------------------------------- ignore_eos / min_new_tokens


def test_sampling_params_from_config_maps_ignore_eos_and_min_new_tokens():
    config = RunConfig.model_validate({"rollout": {"ignore_eos": True, "min_new_tokens": 3, "max_new_tokens": 8}})
    sp = SamplingParams.from_config(config, [1])
    assert sp.ignore_eos and sp.min_new_tokens == 3
    from unirl.config import load_config
    from unirl.kernel.errors import ConfigError

    with pytest.raises(ConfigError, match="min_new_tokens"):
        load_config(None, ["rollout.min_new_tokens=9", "rollout.max_new_tokens=8"])


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "hf"])
def test_torch_engine_ignore_eos_and_min_new_tokens(fast):
    """The greedy first token is made the eos: every row stops at once by default; ignore_eos runs to the
    limit through it; min_new_tokens bans it for the first tokens, with raw (unbanned) log-probs."""
    tok = build_demo_tokenizer()
    eng = build_engine(RunConfig(rollout={"options": {"fast_path": fast}}), adapter=Qwen3Adapter(), tokenizer=tok)
    prompts = [tok.encode(p) for p in ("Q: 1+2=? A:", "hi", "Q: 19*19=?")]

    def run(**kw):
        ss = [Sample(id=f"p{i}", prompt_ids=p, seed=7 + i) for i, p in enumerate(prompts)]
        return eng.generate(ss, SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(tok.eos_token_id,),
                                               **kw))

    eos = {s.response_ids[0] for s in run()}
    eng.eos_ids = set(eos)  # what the model / tokenizer would declare
    stopped = run()
    assert all(len(s.response_ids) == 1 and s.response_ids[0] in eos and s.finish_reason == "stop" for s in stopped)
    free = run(ignore_eos=True)
    assert all(len(s.response_ids) == 6 and s.finish_reason == "length" and s.response_ids[0] in eos for s in free)
    late = run(min_new_tokens=2)
    for s in late:
        assert not eos & set(s.response_ids[:2]) and len(s.response_ids) >= 3
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = eng.model(input_ids=ids).logits[0, len(s.prompt_ids) - 1: -1].float()
        raw = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), raw, atol=1e-5, rtol=0)
