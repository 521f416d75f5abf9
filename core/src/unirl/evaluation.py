"""``unirl eval``: avg@k and pass@k of a model on a data split, with per-prompt results.

Why its own entry point: after training, users want to score an exported model (or any HF directory)
on their own held-out file with the same reward and sampling the trainer uses, on any registered engine,
without building an actor or an optimizer. Only the rollout engine is built.

- ``avg@k``: the mean reward over k samples per prompt (what ``unirl train`` prints as held-out).
- ``pass@k``: the fraction of prompts with at least one of its k samples correct, where correct means
  ``reward >= threshold`` (1.0: a fully correct answer under the built-in 0/1 rewards). Samples whose
  reward failed (NaN) are neither correct nor counted in avg@k; their count is reported.

Why every input is checked before the engine starts: a bad ``--k``, a ``--threshold`` outside the
reward's range (pass@k then reads 0 or 1 whatever the model does) or an ``--out`` that holds a user's
file would otherwise cost a model load and end in a number that means nothing, or a lost file. And an
eval without ``model.path`` scores a freshly initialised model: legal, but it is said first.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from unirl.fsio import atomic_write
from unirl.kernel.errors import ConfigError
from unirl.outputs import claim_output_file
from unirl.writable import disk_errors

#: the keys of every per-prompt line an eval writes (how a later eval recognises the file as its own)
ROW_KEYS = frozenset({"prompt_id", "prompt", "answer", "completions", "rewards", "mean_reward", "pass"})


@dataclass
class EvalResult:
    split: str
    k: int
    prompts: int
    avg_at_k: float
    pass_at_k: float
    failed: int
    per_prompt: Path


def is_eval_output(path: Path) -> bool:
    """An earlier eval's per-prompt JSONL (its first line an object with :data:`ROW_KEYS`), or an empty
    file (nothing to lose): what ``--out`` may overwrite without ``--force``."""
    with open(path, encoding="utf-8") as f:
        first = f.readline(1 << 24)
    if not first.strip():
        return path.stat().st_size == 0
    row = json.loads(first)
    return isinstance(row, dict) and ROW_KEYS <= row.keys()


def reward_range(config: Any, kernel: Any, name: str | None = None) -> tuple[float, float] | None:
    """The closed interval reward ``name`` (default ``reward.name``) scores in; None when unknown.

    A reward may declare it as ``reward_range`` (a ``(low, high)`` tuple, or a callable of the config);
    core's own are known here: the rules and the judge score 0 or 1, a reward model only with
    ``normalize: sigmoid``, and ``weighted`` spans the sum of its weighted terms."""
    from unirl.rewards import builtin
    from unirl.rewards.build import reward_factory
    from unirl.rewards.compose import WeightedSum
    from unirl.rewards.judge import JudgeReward
    from unirl.rewards.reward_model import RewardModelReward

    factory = reward_factory(kernel, name or config.reward.name)
    declared = getattr(factory, "reward_range", None)
    if declared is not None:
        low, high = declared(config) if callable(declared) else declared
        return float(low), float(high)
    if factory in (builtin.exact_int, builtin.math_verify, builtin.math_verify_boxed, JudgeReward):
        return 0.0, 1.0
    if factory is RewardModelReward:
        return (0.0, 1.0) if config.reward.reward_model.normalize == "sigmoid" else None
    if factory is WeightedSum and config.reward.terms:
        low = high = 0.0
        for term, weight in config.reward.terms.items():
            span = reward_range(config, kernel, term)
            if span is None:
                return None
            low, high = low + min(weight * span[0], weight * span[1]), high + max(weight * span[0], weight * span[1])
        return low, high
    return None


def check_threshold(threshold: float, config: Any, kernel: Any | None = None) -> None:
    """``--threshold`` must be a number that some, but not every, reward value reaches: otherwise
    pass@k is 0 (or 1) by construction. The range check needs ``kernel`` (the reward's registration)."""
    fix = "e.g. --threshold 1 for the built-in 0/1 rewards"
    if not math.isfinite(threshold):
        raise ConfigError(f"--threshold {threshold}: not a finite number; pass@k counts samples whose reward is "
                          f">= the threshold (fix: give a number inside the reward's range, {fix})")
    span = reward_range(config, kernel) if kernel is not None else None
    if span is None:
        return
    low, high = span
    if low < threshold <= high:
        return
    what = "no reward can reach it, so pass@k would be 0" if threshold > high else \
        "every reward reaches it, so pass@k would be 1"
    raise ConfigError(f"--threshold {threshold:g}: reward {config.reward.name} scores in [{low:g}, {high:g}]; "
                      f"{what} whatever the model does (fix: choose a threshold in ({low:g}, {high:g}], "
                      f"e.g. --threshold {high:g})")


def samples_per_prompt(k: int | None, config: Any) -> int:
    """``--k``; None (not given) means ``trainer.eval_k``. 0 is not "unset": it is an error."""
    if k is None:
        return config.trainer.eval_k
    if k < 1:
        raise ConfigError(f"--k {k}: need at least one sample per prompt (fix: pass --k 1 or more, or leave "
                          f"--k out to use trainer.eval_k={config.trainer.eval_k})")
    return k


def untrained_note(config: Any) -> str | None:
    """What an eval without ``model.path`` scores, said before anything else."""
    if config.model.path:
        return None
    return ("note: model.path is not set: evaluating a freshly initialised (untrained) model; set "
            "model.path=DIR (e.g. a `unirl export` output) to evaluate a trained one")


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def evaluate_model(config: Any, kernel: Any, *, k: int | None = None, split: str = "eval",
                   out: str | Path | None = None, threshold: float = 1.0, force: bool = False,
                   say: Callable[[str], None] = _stderr) -> EvalResult:
    """Sample k completions per prompt of ``split`` with ``trainer.eval_temperature``, score them with
    ``reward.name``, write one JSON line per prompt to ``out`` (default ``RUN_DIR/eval-<split>.jsonl``):
    the completions' texts and rewards, and each completion whole (``samples``: :func:`unirl.api.sample_row`).

    Every argument is checked before any model is built; ``out`` must be absent, empty or an earlier
    eval's (``force``: any file). ``say`` gets the notes a run prints first (an untrained model)."""
    from unirl.contracts import stop_token_ids
    from unirl.data.datasets import load_prompts
    from unirl.preflight import check
    from unirl.sample_rows import sample_row
    from unirl.trainer.components import build_eval_components
    from unirl.trainer.evaluator import evaluate

    if split not in ("train", "eval"):
        raise ConfigError(f"--split {split!r}: choose train or eval")
    k = samples_per_prompt(k, config)
    check_threshold(threshold, config)  # not a number: before the slower checks
    dest = claim_output_file(Path(out) if out is not None else config.run_dir / f"eval-{split}.jsonl",
                             field="--out" if out is not None else "--out (default)", is_ours=is_eval_output,
                             what="per-prompt eval JSONL", force=force)
    check(config, kernel)  # every violation first, before any model is built
    check_threshold(threshold, config, kernel)  # the reward is known to be registered now
    note = untrained_note(config)
    if note:
        say(note)
    adapter = kernel.build("model_adapters", config.model.adapter)
    tokenizer = adapter.build_tokenizer(config)
    prompts, _ = load_prompts(config, tokenizer, split, adapter)  # bad rows fail here, before the engine starts
    if not prompts:
        raise ConfigError(f"split {split!r} has no prompts; check data.{'source' if split == 'train' else 'eval_source'}")
    # the in-training eval's own path (seeds, sampling, the recipe's controller), with --k as eval_k
    config = config.model_copy(update={"trainer": config.trainer.model_copy(update={"eval_k": k})})
    c = build_eval_components(config, kernel, adapter, tokenizer)
    try:
        slots = evaluate(c, prompts, config, stop_token_ids(config, tokenizer), kernel, step=0,
                         tag=f"evalcli-{split}")
    finally:
        c.close()

    rewards, passes, failed = [], 0, 0
    by_prompt: dict[str, list[Any]] = {}
    for s in slots:  # a controller hands groups back in the order they finished: key them by prompt
        by_prompt.setdefault(s.prompt_id, []).append(s)
    lines = []
    for root in prompts:
        group = sorted(by_prompt.get(root.id, []), key=lambda s: s.id)
        ok = [s.reward for s in group if not math.isnan(s.reward)]
        failed += len(group) - len(ok)
        rewards += ok
        passed = any(r >= threshold for r in ok)
        passes += passed
        lines.append(json.dumps({
            "prompt_id": root.id, "prompt": root.prompt_text, "answer": root.answer,
            "completions": [s.response_text for s in group],
            "rewards": [None if math.isnan(s.reward) else s.reward for s in group],
            "mean_reward": sum(ok) / len(ok) if ok else None, "pass": passed,
            # each completion whole: its Parts (roles, turns, tokens, log-probs) and path id
            # (unirl.api.sample_from_row rebuilds the Sample)
            "samples": [sample_row(s) for s in group],
        }) + "\n")
    with disk_errors(dest, "--out", "the per-prompt results"):  # a full disk: one line, dest as it was
        atomic_write(dest, "".join(lines))
    return EvalResult(split=split, k=k, prompts=len(prompts), avg_at_k=sum(rewards) / max(len(rewards), 1),
                      pass_at_k=passes / len(prompts), failed=failed, per_prompt=dest)


def summary(result: EvalResult) -> str:
    d = asdict(result)
    return (f"{d['split']}: {d['prompts']} prompts x {d['k']} samples: avg@{d['k']} {d['avg_at_k']:.3f}, "
            f"pass@{d['k']} {d['pass_at_k']:.3f}" + (f", {d['failed']} failed rewards" if d["failed"] else "")
            + f"; per prompt: {d['per_prompt']}")
