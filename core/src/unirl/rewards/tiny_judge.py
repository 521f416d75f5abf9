"""A tiny judge for tests and the demo, built by code: ``unirl tiny-judge RECIPE`` (no download).

The judge is a tiny Qwen3 with the demo tokenizer, SFT-trained on synthetic judge prompts rendered
with the recipe's own ``reward.judge.template`` (so what it learns on is byte-identical to what the
judge engine is served): an arithmetic problem of the recipe's *train* split, a candidate answer and
the target verdict `` correct`` / `` incorrect``. The exported directory is what
``reward.judge.model.path`` names.

Why its own loop and not ``unirl sft``: the trainer's SFT puts the loss on the response only, and a
tiny model trained on the verdict alone never learns to compare two numbers: it learns "different
length -> incorrect" (0.72 agreement) and stalls there, or sits at chance when every negative has the
gold's length. Two things make comparison learnable in a few hundred steps (measured, see
docs/rewards.md):

* **hard negatives**: most wrong candidates have the gold's length (off by one or two, a swapped or
  replaced digit), so no length shortcut scores above chance, and every near miss off by one or two
  is always there (:func:`policy_misses`): those are what the policy writes, and a judge that accepts
  one accepts it every step, so GRPO learns the wrong answer (held-out gain +0.09 -> +0.22);
* **loss on the whole judge prompt** (language modelling of the prompt, then the verdict): predicting
  the gold's digits from the candidate's teaches the attention that lines the two numbers up, which is
  exactly what the verdict needs; on the verdict alone that attention gets almost no gradient.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

from unirl.config import RunConfig, load_config
from unirl.data.arith import _OPS, arith_prompt, arith_triples
from unirl.kernel.errors import ConfigError
from unirl.outputs import claim_output_dir, mark_output_dir, replace_output_dir

#: the demo judge's architecture (smaller than the demo policy: it only compares two short numbers)
TINY_JUDGE_BUILD: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 192}
#: the verdicts the judge writes (the default verdict rule parses both; "incorrect" is checked first)
VERDICTS = {True: " correct", False: " incorrect"}
#: SFT steps of a default build (measured at 450 and lr 3e-3; 300 steps at 5e-3 fails, docs/rewards.md)
JUDGE_STEPS = 450
#: the output kind a built judge is marked with (:mod:`unirl.outputs`): a rebuild replaces only these
KIND = "tiny-judge"


def wrong_answers(gold: int, rng: random.Random, k: int) -> list[int]:
    """``k`` distinct wrong candidates for ``gold``: ``k - 1`` hard ones of the gold's length (off by one
    or two or ten, a digit swapped or replaced) and one easy one (a sign flip, an extra digit, a
    random number): what a half-trained policy writes, without a length shortcut."""
    s, sign = str(abs(gold)), "-" if gold < 0 else ""
    hard = {gold + d for d in (-1, 1, -2, 2, -10, 10) if len(str(gold + d)) == len(str(gold))}
    if len(s) == 2 and s[0] != s[1]:
        hard.add(int(sign + s[::-1]))
    for i in range(len(s)):
        for c in "0123456789":
            t = s[:i] + c + s[i + 1:]
            if t != s and not (t[0] == "0" and len(t) > 1):
                hard.add(int(sign + t))
    hard.discard(gold)
    picked = rng.sample(sorted(hard), min(k - 1, len(hard)))
    easy = {gold + d for d in (-10, -3, 3, 10)} | {-gold, gold * 10 + rng.randrange(10), rng.randrange(-9, 19)}
    easy -= {gold, *picked}
    return picked + rng.sample(sorted(easy), min(k - len(picked), len(easy)))


#: the policy's own commonest misses, always in the judge's data (measured on the warm start's samples of
#: train problems: every one of the old judge's false positives was off by one or two, e.g. 3+5 -> 9)
NEAR_MISSES = (-1, 1, -2, 2)


def policy_misses(gold: int, rng: random.Random, k: int) -> list[int]:
    """Wrong candidates for ``gold``: every near miss in :data:`NEAR_MISSES` (of any length: 9 for 10 is
    as common as 9 for 8), then ``k`` more from :func:`wrong_answers`. A greedy judge's mistake on a pair
    the policy writes is systematic: GRPO reinforces that wrong answer at every step, so the pairs the
    policy actually produces must not be left to chance sampling."""
    near = [gold + d for d in NEAR_MISSES]
    return near + [w for w in wrong_answers(gold, rng, k + len(near)) if w not in near][:k]


def judge_rows(config: RunConfig, *, wrong_per_problem: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """SFT rows ``{"prompt": rendered judge prompt, "answer": "correct" | "incorrect"}``, balanced (the
    gold once per wrong candidate), from the train split of ``data.arith`` only (the held-out problems
    stay unseen by the judge too)."""

    class _Row:  # what the template renders from: the policy's prompt text and gold answer
        def __init__(self, text: str, answer: int) -> None:
            self.prompt_text, self.answer = text, answer

    from unirl.rewards.judging import render

    rng = random.Random(seed)
    pool, _ = arith_triples(config.data.arith)
    template = config.reward.judge.template
    rows = []
    for a, op, b in pool:
        gold = _OPS[op](a, b)
        sample = _Row(arith_prompt(a, op, b), gold)
        for w in policy_misses(gold, rng, wrong_per_problem):
            rows.append({"prompt": render(template, f" {w}", sample), "answer": "incorrect"})
            rows.append({"prompt": render(template, f" {gold}", sample), "answer": "correct"})
    rng.shuffle(rows)
    return rows


def build_tiny_judge(config: RunConfig, out: str | Path | None = None, *, steps: int = JUDGE_STEPS, batch_size: int = 64,
                     lr: float = 3e-3, progress: bool = False, build: dict[str, Any] | None = None,
                     force: bool = False) -> Path:
    """SFT a tiny judge for ``config`` (its data.arith, its reward.judge.template) and export it to
    ``out`` (default: ``reward.judge.model.path``). Returns the model directory.

    ``out`` is replaced only when it is absent, empty or an earlier tiny judge (:mod:`unirl.outputs`;
    ``force``: written beside a user's files, never over them): it may name a user's own model, which a rebuild must never delete.

    AdamW at ``lr`` with a linear decay to 0 (the last steps settle the verdict instead of leaving it at
    a noisy peak), cross-entropy on every token of prompt + verdict + eos (see the module docstring)."""
    import torch

    from unirl.actor.skeleton import write_hf_dir
    from unirl.kernel.manager import load_kernel
    from unirl.rewards.judge import encode_judge_prompt

    target = Path(out or config.reward.judge.model.path or "")
    if not str(target) or str(target) == ".":
        raise ConfigError("tiny-judge: set reward.judge.model.path (where the judge goes) or pass an output dir")
    claim_output_dir(target, kind=KIND, field="reward.judge.model.path" if out is None else "tiny-judge out",
                     force=force)
    if steps <= 0 or batch_size <= 0:
        raise ConfigError(f"tiny-judge: steps ({steps}) and batch_size ({batch_size}) must be positive")
    judge_cfg = load_config(None, [f"run.seed={config.run.seed}", "model.adapter=qwen3",
                                   f"model.build={json.dumps(TINY_JUDGE_BUILD if build is None else build)}"])
    adapter = load_kernel().build("model_adapters", "qwen3")
    tok = adapter.build_tokenizer(judge_cfg)
    model = adapter.build_model(judge_cfg, tok)
    chat = config.reward.judge.chat_template
    rows = judge_rows(config, seed=config.run.seed)
    seqs = [encode_judge_prompt(tok, r["prompt"], chat_template=chat) + tok.encode(VERDICTS[r["answer"] == "correct"], add_special_tokens=False)
            + [tok.eos_token_id] for r in rows]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):  # right padding: positions start at 0, as in the engine's prefill
        ids[i, :len(s)] = labels[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 - k / steps)
    gen = torch.Generator().manual_seed(config.run.seed)
    model.train()
    for step in range(steps):
        pick = torch.randint(len(seqs), (min(batch_size, len(seqs)),), generator=gen)
        n = int(mask[pick].sum(1).max())
        loss = model(input_ids=ids[pick, :n], attention_mask=mask[pick, :n], labels=labels[pick, :n]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if progress and (step + 1) % 50 == 0:
            print(f"tiny-judge: step {step + 1}/{steps} loss {loss.item():.3f}", flush=True)
    model.eval()
    claim_output_dir(target, kind=KIND, field="reward.judge.model.path" if out is None else "tiny-judge out",
                     force=force)  # again: the directory may have changed during the SFT
    target.absolute().parent.mkdir(parents=True, exist_ok=True)
    staged = target.absolute().parent / f".{target.name}.unirl-tiny-judge-{os.getpid()}"
    shutil.rmtree(staged, ignore_errors=True)  # a crashed build of this pid; the name is ours
    write_hf_dir(str(staged), model, tok)
    mark_output_dir(staged, KIND)
    # only UniRL's own files in target are replaced (--force writes beside a user's, never over them)
    replace_output_dir(staged, target, kind=KIND, field="reward.judge.model.path" if out is None else "tiny-judge out",
                       force=force)
    return target


def main(argv: list[str]) -> int:
    """``unirl tiny-judge RECIPE [--steps N] [key=value ...]``: build the judge the recipe names."""
    import argparse

    p = argparse.ArgumentParser(prog="unirl tiny-judge", description=main.__doc__)
    p.add_argument("recipe")
    p.add_argument("--steps", type=int, default=JUDGE_STEPS)
    p.add_argument("--force", action="store_true", help="replace reward.judge.model.path even when it is not "
                   "an earlier tiny judge (it may be your own model)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    config = load_config(args.recipe, args.overrides)
    path = build_tiny_judge(config, steps=args.steps, progress=config.trainer.progress, force=args.force)
    print(f"tiny judge: {path} (reward.judge.model.path)")
    return 0
