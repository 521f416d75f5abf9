"""Reward ``reward_model``: a scalar reward model (``AutoModelForSequenceClassification``), in batches.

Why in the trainer's process: a reward model is one forward per text, no sampling, so an engine buys
nothing; it runs under ``torch.inference_mode`` in micro-batches of ``batch_size``, right-padded (the
head reads the last non-pad token). A text longer than ``max_tokens`` fails its sample (NaN) instead of
being truncated, because a truncated completion would be scored on something the policy did not write.

Normalisation (``normalize``): ``sigmoid`` maps logits to (0, 1); ``batch`` z-scores within the rollout
batch; ``running`` z-scores with the mean and variance of every score seen so far in the run
(Welford, this batch included), so the scale stays put as the policy improves.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

from unirl.contracts import BatchReward
from unirl.rewards.judging import render

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import RunConfig
    from unirl.kernel.errors import Violation
    from unirl.samples import Sample


class RunningStats:
    """Welford's running mean and variance (float64)."""

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: list[float]) -> None:
        for x in values:
            self.n += 1
            d = x - self.mean
            self.mean += d / self.n
            self.m2 += d * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.n) if self.n > 1 else 0.0


def zscore(values: list[float], mean: float, std: float) -> list[float]:
    return [(v - mean) / std if std > 1e-12 else 0.0 for v in values]


class RewardModelReward(BatchReward):
    """Scores ``template.format(prompt, completion, answer)`` with a sequence-classification head."""

    reads: ClassVar[tuple[str, ...]] = ("reward_model",)

    @classmethod
    def check(cls, config: RunConfig, kernel: Any) -> list[Violation]:
        from unirl.rewards.checks import reward_model_violations

        return reward_model_violations(config)

    def __init__(self, *, config: RunConfig, kernel: Any = None) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        from unirl.models.tokenizer import load_tokenizer

        self.section = s = config.reward.reward_model
        self.tokenizer = load_tokenizer(s.tokenizer or s.path)
        self.tokenizer.padding_side = "right"
        self.model = AutoModelForSequenceClassification.from_pretrained(s.path, dtype=getattr(torch, s.dtype))
        self.model.eval().requires_grad_(False)
        if self.model.config.pad_token_id is None:  # the head finds the last token by the pad id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.stats = RunningStats()
        self.calls = 0  # forwards run (micro-batches)

    def raw_scores(self, texts: list[str]) -> list[float]:
        """The chosen logit for each text, in micro-batches (no normalisation); NaN for a too-long text."""
        import torch

        s = self.section
        ids = [self.tokenizer.encode(t, add_special_tokens=False) or [self.tokenizer.pad_token_id] for t in texts]
        out = [math.nan] * len(texts)
        ok = [i for i, x in enumerate(ids) if len(x) <= s.max_tokens]
        pad = self.model.config.pad_token_id
        for start in range(0, len(ok), s.batch_size):
            idx = ok[start:start + s.batch_size]
            width = max(len(ids[i]) for i in idx)
            input_ids = torch.full((len(idx), width), pad, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                input_ids[row, :len(ids[i])] = torch.tensor(ids[i])
                mask[row, :len(ids[i])] = 1
            with torch.inference_mode():
                logits = self.model(input_ids=input_ids, attention_mask=mask).logits.float()
            self.calls += 1
            for row, i in enumerate(idx):
                out[i] = float(logits[row, s.label])
        return out

    def score_batch(self, completions: list[str], samples: list[Sample]) -> list[float]:
        s = self.section
        raw = self.raw_scores([render(s.template, c, x) for c, x in zip(completions, samples, strict=True)])
        for v, x in zip(raw, samples, strict=True):
            if math.isnan(v):
                x.meta["reward_error"] = f"reward model text is over reward.reward_model.max_tokens {s.max_tokens}"
        good = [v for v in raw if not math.isnan(v)]
        if s.normalize == "none" or not good:
            return raw
        if s.normalize == "sigmoid":
            return [v if math.isnan(v) else 1.0 / (1.0 + math.exp(-v)) for v in raw]
        if s.normalize == "batch":
            mean = sum(good) / len(good)
            std = math.sqrt(sum((v - mean) ** 2 for v in good) / len(good))
        else:  # running
            self.stats.update(good)
            mean, std = self.stats.mean, self.stats.std
        it = iter(zscore(good, mean, std))
        return [v if math.isnan(v) else next(it) for v in raw]

    def close(self) -> None:
        self.model = None
