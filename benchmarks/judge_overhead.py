"""Trainer step time with the LLM judge as the reward against the rule reward (exact_int).

One run, one policy, one kernel: steps alternate rule / judge (interleaved, so machine load hits both
alike), each a full synchronous trainer step (rollout, scoring, pi_old, GRPO update, weight sync) of
the demo recipe at a reduced size. The judge is a tiny Qwen3 (the ``unirl tiny-judge`` architecture)
served by its own embedded torch engine; ``--judge PATH`` uses a trained one (``reward.judge.model.path``),
otherwise one with random weights is built by code, which costs the same per call, or more: it rarely
stops early, so every verdict runs its whole token budget. With its cache on (the default) verdicts of
repeated (prompt, completion) pairs are free; ``--no-cache`` measures every verdict.

    .venv/bin/python benchmarks/judge_overhead.py [--rounds 5] [--prompts 32] [--n 8] [--no-cache]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def random_judge(out: Path) -> Path:
    import json

    from unirl.config import load_config
    from unirl.models.qwen3 import Qwen3Adapter
    from unirl.models.tokenizer import save_tokenizer
    from unirl.rewards.tiny_judge import TINY_JUDGE_BUILD

    cfg = load_config(None, [f"model.build={json.dumps(TINY_JUDGE_BUILD)}"])
    adapter = Qwen3Adapter()
    tok = adapter.build_tokenizer(cfg)
    adapter.build_model(cfg, tok).save_pretrained(out)
    save_tokenizer(tok, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="steps per side (interleaved)")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--judge", default=None, help="a trained judge directory (default: random weights, built here)")
    ap.add_argument("--no-cache", action="store_true", help="judge every sample (reward.judge.cache_size=0)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared, loaded machine oversubscribes 2)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from unirl.config import load_config
    from unirl.contracts import VersionLedger
    from unirl.data.datasets import PromptCursor, load_prompts
    from unirl.kernel.manager import load_kernel
    from unirl.rewards.build import build_reward
    from unirl.trainer.drivers import Publisher, SyncDriver
    from unirl.trainer.loop import build_components, stop_token_ids
    from unirl.trainer.step import train_on_batch

    out = Path(tempfile.mkdtemp(prefix="judge-bench-"))
    judge_dir = Path(args.judge) if args.judge else random_judge(out / "judge")
    config = load_config(ROOT / "recipes" / "arith-judge-tiny.yaml", [
        f"run.output_dir={out}", "run.name=bench", "trainer.progress=false", f"trainer.prompts_per_step={args.prompts}",
        f"rollout.n={args.n}", f"reward.judge.model.path={judge_dir}", "reward.name=exact_int",
        *(["reward.judge.cache_size=0"] if args.no_cache else []),
        *([] if args.judge else ["reward.judge.verdict.unparsed=zero"])])
    kernel = load_kernel()
    c = build_components(config, kernel)  # the rule reward: exact_int
    rule = c.reward_fn
    judge = build_reward(config.model_copy(update={"reward": config.reward.model_copy(update={"name": "judge"})}),
                         kernel, "judge")
    prompts, _ = load_prompts(config, c.tokenizer, "train")
    cursor = PromptCursor(prompts, config.trainer.prompts_per_step, seed=config.run.seed)
    ledger, stops = VersionLedger(), stop_token_ids(config, c.tokenizer)
    times: dict[str, list[float]] = {"rule": [], "judge": []}
    publisher = Publisher(c, ledger, kernel, config, run_dir=None)
    driver = SyncDriver(c, cursor, config, kernel, stops, publisher)
    try:
        publisher.publish()
        step = 0
        for r in range(args.rounds + 1):  # round 0 warms both sides up and is not counted
            for side, reward in (("rule", rule), ("judge", judge)) if r % 2 == 0 else (("judge", judge), ("rule", rule)):
                c.controller.reward_fn = reward  # the batch controller scores (c.reward_fn stays the rule)
                t0 = time.perf_counter()
                driver.after_update(step, train_on_batch(step, driver.next_batch(step), c, config))
                if r:
                    times[side].append(time.perf_counter() - t0)
                step += 1
    finally:
        c.controller.reward_fn = rule
        judge.close()
        c.close()
    rule_s, judge_s = statistics.median(times["rule"]), statistics.median(times["judge"])
    load = os.getloadavg()[0]
    print(f"samples per step: {args.prompts * args.n}; judge calls {judge.calls}, verdicts computed {judge.misses}, "
          f"cache hits {judge.hits} ({'off' if args.no_cache else 'on'}); load average {load:.1f}")
    print(f"step time, median of {args.rounds}: rule {rule_s:.3f} s, judge {judge_s:.3f} s")
    print(f"judge / rule step-time ratio: {judge_s / rule_s:.2f}x")


if __name__ == "__main__":
    main()
