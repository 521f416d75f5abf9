"""The pieces a :class:`unirl.samples.Sample` is made of: its Parts and Turns, the request record each model
turn leaves, and the fork path ids (see the :mod:`unirl.samples` module doc for the data model).

Why a module of its own: these are plain values with no behaviour of the sample tree; :mod:`unirl.samples`
builds the tree from them and re-exports every name, so ``from unirl.samples import Part`` still works.
No torch import at module load.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Literal

from unirl.kernel.errors import SampleError

SegmentKind = Literal["model", "observation"]

#: rollout log-prob stored for a token the policy did not choose (observation); it never enters a loss
OBSERVATION_LOGPROB = 0.0
#: ``versions`` entry for a token no policy produced
NO_VERSION = -1


def now_ms() -> float:
    """The one clock of request timing: wall time in ms (comparable across processes on a host)."""
    return time.time() * 1000.0


#: roles whose tokens the policy sampled: they train (loss mask 1) and carry log-probs and a version
MODEL_ROLES = frozenset({"model", "tool_call"})
#: the role of the first Part of every sample (its ``prompt_ids``)
PROMPT_ROLE = "prompt"


def trains(role: str) -> bool:
    """The loss mask of a role: only model-produced Parts train."""
    return role in MODEL_ROLES


@dataclass(frozen=True)
class Segment:
    """Deprecated (use :attr:`Sample.parts`): one span ``[start, end)`` of ``response_ids``, a model
    turn or an environment observation."""

    kind: SegmentKind
    turn: int
    start: int
    end: int


@dataclass(frozen=True)
class Span:
    """Where one response Part lives in a sample's flat arrays: ``response_ids[start:end]``, its role,
    the model turn it belongs to, and an opaque ``payload`` (what a non-text stage needs; None for text).

    Why offsets and not the tokens themselves: the flat per-token lists are what packing, the loss and
    every engine read on the hot path; a span is four ints, so a sample stays cheap to pickle across
    processes and the Parts are a view (:attr:`Sample.parts`) with one source of truth."""

    role: str
    turn: int
    start: int
    end: int
    payload: Any = None


@dataclass(frozen=True)
class Part:
    """One piece of a sample's content, in order: the prompt, a model turn, a tool call, an observation,
    or any other role (a string: nothing here assumes text; ``payload`` carries what a non-text stage
    needs, e.g. an image reference or a diffusion latent, opaquely).

    ``logprobs`` (the rollout log-probs, one per token) is set only where the model produced the Part
    (:data:`MODEL_ROLES`); ``version`` is the weight version that produced it (:data:`NO_VERSION`
    otherwise; one per Part: a model call is sampled by one policy). ``turn`` is the model call the
    Part belongs to or answers (-1: the prompt). Frozen, but ``tokens`` is a plain list (cheap): do not
    mutate it."""

    role: str
    tokens: list[int]
    logprobs: list[float] | None = None
    version: int = NO_VERSION
    turn: int = -1
    payload: Any = None

    @property
    def trains(self) -> bool:
        return trains(self.role)


@dataclass(frozen=True)
class Turn:
    """One model call (its model-produced Parts) and the environment's response to it (the Parts that
    follow until the next call). ``start``/``end`` are offsets in ``response_ids``."""

    index: int
    parts: list[Part]
    start: int
    end: int
    context: list[Part]

    def conditioning(self) -> list[Part]:
        """Exactly the Parts this turn was generated from: the prompt and every Part before the call
        (their tokens, concatenated, are the ids the engine prefilled for it)."""
        return list(self.context)

    @property
    def model_parts(self) -> list[Part]:
        return [p for p in self.parts if p.trains]


_FORK = re.compile(r"f(\d+)\.(\d+)")


def fork_id(parent_id: str, at_turn: int, branch: int) -> str:
    """The path id of branch ``branch`` of a fork of ``parent_id`` taken before its turn ``at_turn``."""
    if at_turn < 0 or branch < 0:
        raise SampleError(f"fork of {parent_id}: at_turn ({at_turn}) and branch ({branch}) must be >= 0")
    return f"{parent_id}/f{at_turn}.{branch}"


def fork_point(sample_id: str) -> tuple[str, int, int] | None:
    """``(parent id, at_turn, branch)`` when the last path component is a fork, else None."""
    parent, _, last = sample_id.rpartition("/")
    m = _FORK.fullmatch(last)
    return (parent, int(m.group(1)), int(m.group(2))) if parent and m else None


#: the layers of the sample tree an estimator can group by (``algorithm.group_layer``)
GroupLayer = Literal["root", "turn", "fork"]


@dataclass
class RequestRecord:
    """One model turn as the engine served it. Times are :func:`now_ms`; 0.0 means not reached."""

    turn: int
    engine: str = ""
    worker: str = ""
    version: int = NO_VERSION
    prompt_tokens: int = 0
    new_tokens: int = 0
    submitted_ms: float = 0.0
    first_token_ms: float = 0.0
    finished_ms: float = 0.0
    finish_reason: str = ""
    #: prompt tokens the engine served from its prefix cache (-1: the engine does not report it)
    cached_tokens: int = -1
    #: tokens in the engine's prefix cache when this request was submitted (0: empty; -1: unknown).
    #: Why: a replay starts from a cold cache; a batch that started warm is flagged, not silently compared.
    cache_tokens_at_submit: int = -1
    #: environment / tool time (ms) spent on this turn's output before the next turn was submitted, as the
    #: controller measured it (-1: not measured). The rest of the gap between turns is controller overhead.
    tool_ms: float = -1.0
