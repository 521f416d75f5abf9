"""Rollout throughput: the embedded TorchEngine against transformers' ``generate`` on the same model.

Builds the tiny Qwen3 from unirl's defaults, samples ``--prompts`` arithmetic prompts x
``--new-tokens`` tokens (no early stop, so every runner produces the same token count), warms each
runner up once, then times ``--repeats`` runs and prints tokens/s and the ratio against HF.

Runners live in ``RUNNERS`` (name -> factory(model, tokenizer, config) -> callable(prompts) -> tokens);
another engine (e.g. the vLLM plugin) adds a column by adding an entry.

    python benchmarks/rollout_throughput.py [--prompts 64] [--new-tokens 64] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from unirl.api import build_engine

Runner = Callable[[list[list[int]]], int]  # prompts -> number of generated tokens


def hf_generate(model: Any, tokenizer: Any, config: Any, args: argparse.Namespace) -> Runner:
    """transformers ``generate`` with sampling and per-step logits returned (what an RL rollout needs)."""
    import torch

    def run(prompts: list[list[int]]) -> int:
        enc = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(
                **enc, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=True,
                temperature=1.0, top_k=0, top_p=1.0, output_logits=True, return_dict_in_generate=True,
                pad_token_id=tokenizer.pad_token_id, use_cache=True,
            )
        return int(out.sequences.shape[0] * (out.sequences.shape[1] - enc["input_ids"].shape[1]))

    return run


def torch_engine(model: Any, tokenizer: Any, config: Any, args: argparse.Namespace) -> Runner:
    """unirl's embedded TorchEngine (its own copy of the same weights)."""
    from unirl.contracts import SamplingParams
    from unirl.models.qwen3 import Qwen3Adapter
    from unirl.samples import Sample

    cfg = config.model_copy(deep=True)  # its own options: other runners may set theirs on config
    cfg.rollout.options = {"batch_size": max(args.prompts, 1)}
    cfg.rollout.engine = "torch"
    engine = build_engine(cfg, adapter=Qwen3Adapter(), tokenizer=tokenizer, model=model)
    # no stop tokens: every row runs to max_new_tokens, like min_new_tokens on the HF side
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    engine.eos_ids = set()

    def run(prompts: list[list[int]]) -> int:
        samples = [Sample(id=f"p{i}", prompt_ids=p) for i, p in enumerate(prompts)]
        engine.generate(samples, sampling)
        return sum(len(s.response_ids) for s in samples)

    return run


def vllm_engine(model: Any, tokenizer: Any, config: Any, args: argparse.Namespace) -> Runner:
    """unirl-vllm's VLLMEngine: in-process vllm.LLM on the same weights (saved to a temp dir), EOS ignored."""
    import os
    import tempfile

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from unirl.contracts import SamplingParams
    from unirl.models.qwen3 import Qwen3Adapter
    from unirl.samples import Sample

    path = tempfile.mkdtemp(prefix="unirl-bench-vllm-")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    cfg = config.model_copy(update={"model": config.model.model_copy(update={"path": path})})
    cfg.rollout.options = {"ignore_eos": True, "kv_cache_gb": 1.0}
    cfg.rollout.engine = "vllm"
    engine = build_engine(cfg, adapter=Qwen3Adapter(), tokenizer=tokenizer)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)

    def run(prompts: list[list[int]]) -> int:
        samples = engine.generate([Sample(id=f"p{i}", prompt_ids=p) for i, p in enumerate(prompts)], sampling)
        return sum(len(s.response_ids) for s in samples)

    return run


RUNNERS: dict[str, Callable[..., Runner]] = {"hf_generate": hf_generate, "torch_engine": torch_engine}
try:  # a column only where unirl-vllm is installed (importing the package does not import vLLM)
    import unirl_vllm  # noqa: F401
except ImportError:
    pass
else:
    RUNNERS["vllm_engine"] = vllm_engine
BASELINE = "hf_generate"


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 keeps torch's default)")
    parser.add_argument("--runners", default=",".join(RUNNERS), help="comma-separated subset of " + ",".join(RUNNERS))
    args = parser.parse_args(argv)

    import torch

    from unirl.config import RunConfig
    from unirl.models.qwen3 import Qwen3Adapter
    from unirl.models.tokenizer import build_demo_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    config = RunConfig(rollout={"options": {"batch_size": max(args.prompts, 1)}})
    tokenizer = build_demo_tokenizer()
    model = Qwen3Adapter().build_model(config, tokenizer).eval()
    prompts = [tokenizer.encode(f"Q: {i % 20}+{(7 * i) % 13}=? A:") for i in range(args.prompts)]

    results: dict[str, float] = {}
    for name in args.runners.split(","):
        run = RUNNERS[name](model, tokenizer, config, args)
        run(prompts)  # warm-up
        rates = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            n = run(prompts)
            rates.append(n / (time.perf_counter() - t0))
        results[name] = statistics.median(rates)

    params = sum(p.numel() for p in model.parameters())
    print(f"tiny Qwen3 ({params / 1e6:.2f} M params), {args.prompts} prompts x {args.new_tokens} new tokens, "
          f"fp32, {torch.get_num_threads()} threads, median of {args.repeats}")
    base, embedded = results.get(BASELINE), results.get("torch_engine")
    print(f"{'runner':<16}{'tokens/s':>12}{'vs ' + BASELINE:>18}{'vs torch_engine':>18}")
    for name, rate in results.items():
        vs_hf = f"{rate / base:.2f}x" if base else "-"
        vs_embedded = f"{rate / embedded:.2f}x" if embedded else "-"
        print(f"{name:<16}{rate:>12,.0f}{vs_hf:>18}{vs_embedded:>18}")
    if base and embedded:
        print(f"engine/hf = {embedded / base:.2f} (target >= 1.5)")
    return results


if __name__ == "__main__":
    main()
