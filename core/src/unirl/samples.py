"""The data model: a tree of samples keyed by path ids.

A root prompt has id ``p17``; its n generations are ``p17/0 .. p17/{n-1}``; turns of an agentic
trajectory would nest below them. Lineage lives *in the id*, so a GRPO group is a projection
(``group_id`` = parent id) that survives split, concat, shuffle and rank sharding with no remapping
table to keep in sync.

Plain Python lists here (not tensors): samples cross process boundaries (Ray, vLLM workers) and are
small next to the model. Tensors are built once per micro-batch by :mod:`unirl.packing`.
No torch import at module load.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

Status = Literal["pending", "ok", "truncated", "failed"]


@dataclass
class Sample:
    """One prompt (root) or one generated trajectory (child).

    ``response_ids``, ``loss_mask``, ``rollout_logprobs`` and ``versions`` are aligned token by token.
    ``loss_mask`` is 0 for tokens the policy did not choose (tool observations). ``versions[i]`` is the
    weight version of the policy that sampled token i. ``reward`` is NaN for a *failed* trajectory (an
    infrastructure fault): it is excluded from its group's statistics and gets zero advantage.
    """

    id: str
    prompt_ids: list[int]
    prompt_text: str = ""
    answer: Any = None
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "stop" | "length" | "error"
    status: Status = "pending"
    reward: float = math.nan
    seed: int | None = None
    response_text: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    # ---------------------------------------------------------------- lineage
    @property
    def parent_id(self) -> str:
        return self.id.rpartition("/")[0]

    @property
    def group_id(self) -> str:
        """Siblings (the n generations of one prompt) share this id."""
        return self.parent_id or self.id

    @property
    def depth(self) -> int:
        return self.id.count("/")

    def child(self, index: int, **kwargs: Any) -> Sample:
        """A generation slot under this prompt: same prompt, fresh response fields."""
        return Sample(
            id=f"{self.id}/{index}",
            prompt_ids=list(self.prompt_ids),
            prompt_text=self.prompt_text,
            answer=self.answer,
            meta=dict(self.meta),
            **kwargs,
        )

    # ---------------------------------------------------------------- views
    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def failed(self) -> bool:
        return self.status == "failed" or math.isnan(self.reward)

    def mark_failed(self, reason: str) -> None:
        self.status = "failed"
        self.reward = math.nan
        self.meta["error"] = reason

    def copy(self) -> Sample:
        return replace(
            self,
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            loss_mask=list(self.loss_mask),
            rollout_logprobs=list(self.rollout_logprobs),
            versions=list(self.versions),
            meta=dict(self.meta),
        )

    def validate(self) -> None:
        """Raise ValueError when the aligned per-token lists disagree (an engine bug)."""
        n = len(self.response_ids)
        for name in ("loss_mask", "rollout_logprobs", "versions"):
            got = len(getattr(self, name))
            if got != n:
                raise ValueError(f"sample {self.id}: {name} has {got} entries for {n} response tokens")


def expand(prompts: Iterable[Sample], n: int, *, base_seed: int | None = None, step: int = 0) -> list[Sample]:
    """Make the n generation slots of each prompt, with per-request seeds derived from the id.

    Seeds depend on (base_seed, step, id) only, so a resumed run samples exactly what the uninterrupted
    run would have, whatever the batch composition.
    """
    out = []
    for p in prompts:
        for i in range(n):
            child = p.child(i)
            if base_seed is not None:
                child.seed = stable_seed(base_seed, step, child.id)
            out.append(child)
    return out


def stable_seed(*parts: Any) -> int:
    """A 63-bit seed from values, stable across processes (unlike ``hash``)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def groups(samples: Sequence[Sample]) -> dict[str, list[Sample]]:
    """Siblings grouped by parent id, in first-seen order. Works on any subset or shuffle."""
    out: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        out[s.group_id].append(s)
    return dict(out)


def shuffle(samples: Sequence[Sample], seed: int) -> list[Sample]:
    out = list(samples)
    random.Random(seed).shuffle(out)
    return out


def split(samples: Sequence[Sample], parts: int, *, keep_groups: bool = True) -> list[list[Sample]]:
    """Split into ``parts`` chunks balanced by token count.

    With ``keep_groups`` siblings stay in one chunk (estimators that need the group can run per chunk).
    Greedy largest-first bin packing: deterministic, and within one item of optimal for our sizes.
    """
    units: list[list[Sample]] = list(groups(samples).values()) if keep_groups else [[s] for s in samples]
    units.sort(key=lambda u: (-sum(s.num_tokens for s in u), u[0].id))
    bins: list[list[Sample]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for unit in units:
        i = min(range(parts), key=lambda k: (loads[k], k))
        bins[i].extend(unit)
        loads[i] += sum(s.num_tokens for s in unit)
    return bins


def chunks(samples: Sequence[Sample], size: int) -> list[list[Sample]]:
    return [list(samples[i : i + size]) for i in range(0, len(samples), size)]
