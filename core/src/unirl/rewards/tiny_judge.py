"""A tiny judge for tests and the demo, built by code: ``unirl tiny-judge RECIPE`` (no download).

Why SFT through the trainer: the judge is a tiny Qwen3 with the demo tokenizer, warm-started by the
same ``unirl sft`` path a policy uses (:func:`unirl.trainer.loop.train` with ``rl=False``), on
synthetic judge prompts rendered with the recipe's own ``reward.judge.template``: an arithmetic
problem of the recipe's *train* split, a candidate answer (the gold one, or a near miss: off by one
or two, a sign flip, an extra digit, a random number) and the target verdict ``correct`` /
``incorrect``. The exported directory is what ``reward.judge.model.path`` names.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

from unirl.config import RunConfig, load_config
from unirl.data.arith import _OPS, arith_prompt, arith_triples
from unirl.kernel.errors import ConfigError

#: the demo judge's architecture (smaller than the demo policy: it only compares two short numbers)
TINY_JUDGE_BUILD: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 192}


def wrong_answers(gold: int, rng: random.Random, k: int) -> list[int]:
    """``k`` distinct near misses of ``gold``: what a half-trained policy writes."""
    pool = {gold + d for d in (-10, -3, -2, -1, 1, 2, 3, 10)} | {-gold, gold * 10 + rng.randrange(10),
                                                               rng.randrange(-9, 19), int(str(abs(gold))[::-1])}
    pool.discard(gold)
    return rng.sample(sorted(pool), min(k, len(pool)))


def judge_rows(config: RunConfig, *, wrong_per_problem: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """SFT rows ``{"prompt": rendered judge prompt, "answer": "correct" | "incorrect"}``, balanced, from
    the train split of ``data.arith`` only (the held-out problems stay unseen by the judge too)."""

    class _Row:  # what the template renders from: the policy's prompt text and gold answer
        def __init__(self, text: str, answer: int) -> None:
            self.prompt_text, self.answer = text, answer

    from unirl.rewards.judge import render

    rng = random.Random(seed)
    pool, _ = arith_triples(config.data.arith)
    template = config.reward.judge.template
    rows = []
    for a, op, b in pool:
        gold = _OPS[op](a, b)
        sample = _Row(arith_prompt(a, op, b), gold)
        for w in wrong_answers(gold, rng, wrong_per_problem):
            rows.append({"prompt": render(template, f" {w}", sample), "answer": "incorrect"})
            rows.append({"prompt": render(template, f" {gold}", sample), "answer": "correct"})
    rng.shuffle(rows)
    return rows


def build_tiny_judge(config: RunConfig, out: str | Path | None = None, *, steps: int = 300, batch_size: int = 64,
                     lr: float = 3e-3, progress: bool = False, build: dict[str, Any] | None = None) -> Path:
    """SFT a tiny judge for ``config`` (its data.arith, its reward.judge.template) and export it to
    ``out`` (default: ``reward.judge.model.path``). Returns the model directory."""
    from unirl.kernel.manager import load_kernel
    from unirl.trainer.loop import train

    target = Path(out or config.reward.judge.model.path or "")
    if not str(target) or str(target) == ".":
        raise ConfigError("tiny-judge: set reward.judge.model.path (where the judge goes) or pass an output dir")
    if target.exists() and not (target / "config.json").is_file():
        raise ConfigError(f"tiny-judge: {target} exists and is not a model directory; pick another path")
    work = target.with_name(target.name + ".sft")
    work.mkdir(parents=True, exist_ok=True)
    data = work / "judge-train.jsonl"
    rows = judge_rows(config, seed=config.run.seed)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "judge-eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:16]))  # SFT runs no eval
    sft = load_config(None, [
        f"run.output_dir={work}", "run.name=run", f"run.seed={config.run.seed}", f"data.source={data}",
        f"data.eval_source={work / 'judge-eval.jsonl'}",
        "data.max_prompt_tokens=128", f"model.build={json.dumps(TINY_JUDGE_BUILD if build is None else build)}",
        f"sft.steps={steps}", f"sft.batch_size={batch_size}", f"sft.lr={lr}",
        f"trainer.progress={str(progress).lower()}", "trainer.plot=false"])
    train(sft, load_kernel(), rl=False)
    if target.exists():
        shutil.rmtree(target)
    shutil.move(str(work / "run" / "hf"), str(target))
    shutil.rmtree(work, ignore_errors=True)
    return target


def main(argv: list[str]) -> int:
    """``unirl tiny-judge RECIPE [--steps N] [key=value ...]``: build the judge the recipe names."""
    import argparse

    p = argparse.ArgumentParser(prog="unirl tiny-judge", description=main.__doc__)
    p.add_argument("recipe")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    config = load_config(args.recipe, args.overrides)
    path = build_tiny_judge(config, steps=args.steps, progress=config.trainer.progress)
    print(f"tiny judge: {path} (reward.judge.model.path)")
    return 0
