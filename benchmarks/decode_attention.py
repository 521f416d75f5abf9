"""The embedded engine's decode step with its attention over the whole KV cache against over the slice of
it written so far (``FastDecoder.whole_cache``), per dtype, on one ``vs_trl.py`` model size. The whole
cache is the written 128-column blocks (``fast_decoder.CACHE_BLOCK``: it grows a block at a time), the
later columns of the last block masked.

Why: a decode step attends each row's query to the keys written so far. In bf16 the CPU's batched
matmul copies a slice of the cache (it is not contiguous) and then runs a slower kernel, so the decoder
attends over the whole zero-filled cache with the later columns masked; in fp32 the slice is not copied
and stays. This script is the measurement behind that choice: it times the decoder's real decode loop
both ways, in fresh caches, best of ``--repeats``, and prints the ratio whole / slice per dtype and
response length (below 1: the whole cache is faster). Beside it, the decode's matmul FLOP/s (2 N per
row and step, N the matmul parameters) as a share of a plain mm of the step's shape in the same dtype,
measured in the same process: decode at 64 rows is bound by reading the weights, so expect a fraction.

Run: ``python benchmarks/decode_attention.py [--size 25m] [--lengths 64,256] [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step_vs_floor import matmul_params, mm_flops  # noqa: E402
from vs_trl import BASE, SIZES  # noqa: E402

from unirl.engine.fast_decoder import FastDecoder  # noqa: E402

ROWS, PROMPT = 64, 16  # vs_trl.py's 16 prompts x 4 samples, each prompt about 16 tokens


def decode_s(decoder: FastDecoder, length: int, repeats: int) -> float:
    """Seconds per decode step, best of ``repeats`` decodes of ``length`` steps from a fresh prefill."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, BASE["vocab_size"], (ROWS, PROMPT), generator=g)
    pos = torch.arange(PROMPT)[None].expand(ROWS, PROMPT)
    valid = torch.ones(ROWS, PROMPT + length, dtype=torch.bool)
    tok = torch.randint(0, BASE["vocab_size"], (ROWS, 1), generator=g)
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            state = decoder.prefill(ids, pos, valid, length)
            t = time.perf_counter()
            for i in range(length):
                decoder.step(state, tok, torch.full((ROWS, 1), PROMPT + i), PROMPT + i)
            best = min(best, (time.perf_counter() - t) / length)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="25m", choices=list(SIZES))
    ap.add_argument("--lengths", default="64,256")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="3m, 64 tokens, 1 repeat")
    args = ap.parse_args()
    if args.quick:
        args.size, args.lengths, args.repeats = "3m", "64", 1
    torch.set_num_threads(args.threads)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**{**BASE, **SIZES[args.size]})
    cfg._attn_implementation = "sdpa"
    print(f"decode attention, {args.size}, {ROWS} rows x {PROMPT}-token prompts, {args.threads} threads, best of "
          f"{args.repeats}: ms per decode step, attention over the whole cache / the slice written so far")
    worst = 0.0
    for dtype in (torch.bfloat16, torch.float32):
        model = Qwen3ForCausalLM(cfg).to(dtype).eval().requires_grad_(False)
        decoder = FastDecoder(model, dtype)
        chosen = decoder.whole_cache
        ceiling = mm_flops(ROWS, cfg.hidden_size, cfg.intermediate_size, dtype)
        flop_per_step = 2 * matmul_params(model) * ROWS
        for length in map(int, args.lengths.split(",")):
            times = {}
            for whole in (True, False):
                decoder.whole_cache = whole
                times[whole] = decode_s(decoder, length, args.repeats)
            ratio = times[True] / times[False]
            best = min(times.values())
            mine = times[chosen]
            worst = max(worst, mine / best)
            print(f"  {str(dtype).removeprefix('torch.'):8} {length:5d} tokens: whole {1e3 * times[True]:7.2f}, "
                  f"slice {1e3 * times[False]:7.2f} ms/step, ratio {ratio:.2f}; the decoder uses "
                  f"{'whole' if chosen else 'slice'}; {flop_per_step / best / 1e9:.1f} GFLOP/s = "
                  f"{flop_per_step / best / ceiling:.0%} of a [{ROWS} x {cfg.hidden_size}] @ "
                  f"[{cfg.hidden_size} x {cfg.intermediate_size}] mm ({ceiling / 1e9:.1f} GFLOP/s)")
        decoder.whole_cache = chosen
    # the decoder's choice against the faster of the two, at every cell: 1.00 when it picked the faster
    print(f"chosen / faster: {worst:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
