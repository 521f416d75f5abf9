"""``unirl eval``: avg@k and pass@k of a model on a data split, with per-prompt results.

Why its own entry point: after training, users want to score an exported model (or any HF directory)
on their own held-out file with the same reward and sampling the trainer uses, on any registered engine,
without building an actor or an optimizer. Only the rollout engine is built.

- ``avg@k``: the mean reward over k samples per prompt (what ``unirl train`` prints as held-out).
- ``pass@k``: the fraction of prompts with at least one of its k samples correct, where correct means
  ``reward >= threshold`` (1.0: a fully correct answer under the built-in 0/1 rewards). Samples whose
  reward failed (NaN) are neither correct nor counted in avg@k; their count is reported.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from unirl.kernel.errors import ConfigError


@dataclass
class EvalResult:
    split: str
    k: int
    prompts: int
    avg_at_k: float
    pass_at_k: float
    failed: int
    per_prompt: Path


def evaluate_model(config: Any, kernel: Any, *, k: int | None = None, split: str = "eval",
                   out: str | Path | None = None, threshold: float = 1.0) -> EvalResult:
    """Sample k completions per prompt of ``split`` with ``trainer.eval_temperature``, score them with
    ``reward.name``, write one JSON line per prompt to ``out`` (default ``RUN_DIR/eval-<split>.jsonl``)."""
    from unirl.contracts import SamplingParams
    from unirl.data.datasets import load_prompts
    from unirl.preflight import check
    from unirl.rewards.build import build_reward, close_reward
    from unirl.rewards.builtin import score
    from unirl.runtime import build_runtime
    from unirl.samples import expand
    from unirl.trainer.loop import stop_token_ids

    if split not in ("train", "eval"):
        raise ConfigError(f"--split {split!r}: choose train or eval")
    k = k or config.trainer.eval_k
    if k < 1:
        raise ConfigError(f"--k {k}: need at least one sample per prompt")
    check(config, kernel)  # every violation first, before any model is built
    adapter = kernel.build("model_adapters", config.model.adapter)
    tokenizer = adapter.build_tokenizer(config)
    prompts, _ = load_prompts(config, tokenizer, split)  # bad rows fail here, before the engine starts
    if not prompts:
        raise ConfigError(f"split {split!r} has no prompts; check data.{'source' if split == 'train' else 'eval_source'}")
    runtime = build_runtime(config, kernel, adapter=adapter)
    engine = kernel.build("rollout_engines", config.rollout.engine, config=config, adapter=adapter,
                          tokenizer=tokenizer, runtime=runtime)
    try:
        slots = expand(prompts, k, tag=f"evalcli-{split}", seed_tag="eval", base_seed=config.run.seed + 7919)
        sampling = SamplingParams.from_config(config, stop_token_ids(config, tokenizer),
                                              temperature=config.trainer.eval_temperature)
        engine.generate(slots, sampling)
    finally:
        engine.close()
    reward = build_reward(config, kernel)  # a judge or reward model is built once the policy's engine is done
    try:
        score(slots, reward)
    finally:
        close_reward(reward)

    dest = Path(out) if out is not None else config.run_dir / f"eval-{split}.jsonl"
    dest.parent.mkdir(parents=True, exist_ok=True)
    rewards, passes, failed = [], 0, 0
    by_prompt: dict[str, list[Any]] = {}
    for s in slots:
        by_prompt.setdefault(s.group_id, []).append(s)
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "w") as f:
        for root, group in zip(prompts, by_prompt.values(), strict=True):
            ok = [s.reward for s in group if not math.isnan(s.reward)]
            failed += len(group) - len(ok)
            rewards += ok
            passed = any(r >= threshold for r in ok)
            passes += passed
            f.write(json.dumps({
                "prompt_id": root.id, "prompt": root.prompt_text, "answer": root.answer,
                "completions": [s.response_text for s in group],
                "rewards": [None if math.isnan(s.reward) else s.reward for s in group],
                "mean_reward": sum(ok) / len(ok) if ok else None, "pass": passed,
            }) + "\n")
    tmp.replace(dest)
    return EvalResult(split=split, k=k, prompts=len(prompts), avg_at_k=sum(rewards) / max(len(rewards), 1),
                      pass_at_k=passes / len(prompts), failed=failed, per_prompt=dest)


def summary(result: EvalResult) -> str:
    d = asdict(result)
    return (f"{d['split']}: {d['prompts']} prompts x {d['k']} samples: avg@{d['k']} {d['avg_at_k']:.3f}, "
            f"pass@{d['k']} {d['pass_at_k']:.3f}" + (f", {d['failed']} failed rewards" if d["failed"] else "")
            + f"; per prompt: {d['per_prompt']}")
