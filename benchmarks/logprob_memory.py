"""Peak memory and time of the actor's log-probs at a realistic vocabulary: chunked against the whole logits.

Why: the actor's replay and training forward took the output projection of every target token at once,
``[tokens, vocab]`` in fp32, and a log-softmax of the same size kept for the backward: at Qwen3's
151,936-token vocabulary that outgrows the model (issue 65 item 6). ``unirl.actor.chunked_logprobs``
runs it one checkpointed chunk of ~256 MiB of logits at a time. This script measures, per micro-batch
size, for the replay (no grad) and a training forward + backward:

* peak memory: the peak of torch-allocated bytes during the call (torch's profiler, every allocation
  and free in order, above what was live at the start): machine-independent;
* time: the median of ``--reps`` calls, the two paths interleaved call by call, as wall seconds and as
  the process's CPU seconds (all threads): on a shared, loaded machine the CPU time is the steadier.

Baseline, in the same run: the direct path as it was before chunking (:func:`direct`, kept here).
The model is a tiny Qwen3 (hidden 64, 2 layers) so that the head dominates, as it does at 8 k tokens
in a real model's micro-batch. ``--raw`` / processed: ``--processing`` sets temperature / top-k / top-p.

    .venv/bin/python benchmarks/logprob_memory.py --tokens 1024 2048
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from unirl.actor.chunked_logprobs import chunk_bounds, forward_logprobs
from unirl.logprobs import LogprobProcessing, logprobs_of
from unirl.packing import enable_packed_attention, pack
from unirl.samples import Sample


def direct(model, packed, processing=None, with_entropy=True):
    """The pre-chunking path: the whole ``[N, V]`` fp32 logits, log-softmax, gather (the baseline)."""
    out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                logits_to_keep=packed.target_index)
    logp_all = logprobs_of(out.logits[0].float(), processing, sampled=packed.target_ids)
    logp = logp_all.gather(-1, packed.target_ids[:, None]).squeeze(-1)
    if with_entropy:
        with torch.no_grad():
            torch.special.entr(logp_all.detach().exp()).sum(-1)
    return logp


def chunked(model, packed, processing=None, with_entropy=True):
    return forward_logprobs(model, packed, with_entropy=with_entropy, processing=processing)[0]


def build(vocab: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                      pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).float()
    model.config.use_cache = False
    enable_packed_attention(model)
    return model


def batch(vocab: int, tokens: int):
    """Sequences of 16 prompt + 240 response tokens (the last one shorter): ``tokens`` targets in all."""
    g = torch.Generator().manual_seed(1)
    lens = [240] * (tokens // 240) + ([tokens % 240] if tokens % 240 else [])
    return pack([Sample(id=f"s{i}", prompt_ids=torch.randint(2, vocab, (16,), generator=g).tolist(),
                        response_ids=torch.randint(2, vocab, (n,), generator=g).tolist())
                 for i, n in enumerate(lens)])


def peak_bytes(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    current = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def calls(model, packed, processing):
    """``{phase: {path: fn}}``: the replay (no grad) and a training forward + backward."""
    def train(path):
        def run():
            model.zero_grad(set_to_none=True)
            path(model, packed, processing).sum().backward()
        return run

    def replay(path):
        def run():
            with torch.no_grad():
                path(model, packed, processing, with_entropy=False)
        return run

    return {"replay": {"direct": replay(direct), "chunked": replay(chunked)},
            "train": {"direct": train(direct), "chunked": train(chunked)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151_936, help="Qwen3's vocabulary by default")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048], help="target tokens per micro-batch")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per path (interleaved), after one warm-up")
    ap.add_argument("--processing", type=float, nargs=3, metavar=("T", "TOP_K", "TOP_P"), default=None,
                    help="processed log-probs (temperature, top-k, top-p); raw by default")
    args = ap.parse_args()
    processing = None
    if args.processing:
        t, k, p = args.processing
        processing = LogprobProcessing(temperature=t, top_k=int(k), top_p=p)
    model = build(args.vocab)
    print(f"vocab {args.vocab}, processing {processing}, torch threads {torch.get_num_threads()}")
    print(f"{'tokens':>6} {'chunks':>6} {'phase':>7} | {'peak MB direct':>14} {'chunked':>8} {'ratio':>6} | "
          f"{'wall s direct':>13} {'chunked':>8} {'ratio':>6} | {'cpu s direct':>12} {'chunked':>8} {'ratio':>6}")
    for tokens in args.tokens:
        packed = batch(args.vocab, tokens)
        n_chunks = len(chunk_bounds(packed.num_tokens, args.vocab))
        for phase, paths in calls(model, packed, processing).items():
            peaks = {name: peak_bytes(fn) for name, fn in paths.items()}
            wall: dict[str, list[float]] = {name: [] for name in paths}
            cpu: dict[str, list[float]] = {name: [] for name in paths}
            for rep in range(args.reps + 1):
                for name, fn in paths.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    fn()
                    if rep:
                        wall[name].append(time.perf_counter() - t0)
                        cpu[name].append(time.process_time() - c0)
            w = {name: statistics.median(v) for name, v in wall.items()}
            c = {name: statistics.median(v) for name, v in cpu.items()}
            print(f"{packed.num_tokens:>6} {n_chunks:>6} {phase:>7} | {peaks['direct'] / 2**20:>14.0f} "
                  f"{peaks['chunked'] / 2**20:>8.0f} {peaks['direct'] / peaks['chunked']:>5.1f}x | "
                  f"{w['direct']:>13.3f} {w['chunked']:>8.3f} {w['chunked'] / w['direct']:>5.2f}x | "
                  f"{c['direct']:>12.3f} {c['chunked']:>8.3f} {c['chunked'] / c['direct']:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
