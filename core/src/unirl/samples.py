"""The data model: a tree of samples keyed by path ids.

A dataset prompt has id ``p17``. Each time it is *launched* (drawn for a rollout) it gets a launch
tag, and its n generations are ``p17@train-3/0 .. p17@train-3/{n-1}``; turns of an agentic trajectory
may nest below them. Lineage lives *in the id*, so a GRPO group is a projection (``group_id`` = the
first path component, ``p17@train-3``) that survives split, concat, shuffle, rank sharding and any
turn depth with no remapping table to keep in sync. Because the launch tag is in the id, two launches
of one prompt (two steps, two async drives, an epoch later) never merge into one group, and a request
id never repeats in a run.

**Forks.** A branch of a trajectory taken before its turn k is a child whose path extends the
parent's by ``f{k}.{b}``: ``p17@train-3/0/f2.1`` is branch 1 of the fork of ``p17@train-3/0`` at turn 2
(it shares the parent's Parts up to the conditioning of turn 2). Forks nest
(``p17@train-3/0/f2.1/f4.0``). The *fork group* of a sample is its path with the last fork's branch
index dropped (``p17@train-3/0/f2``): the siblings branched from one point. A sample with no fork
component is a branch of the launch itself, so its fork group is its ``group_id``. Every fork group and
every turn group lies inside one root group, so anything that keeps root groups whole (``split``,
rank sharding) keeps every layer's groups whole (``algorithm.group_layer``, docs/algorithms.md).

**Parts.** A sample's content is an ordered list of :class:`Part` (:attr:`Sample.parts`): the prompt,
then each span the model produced (role ``model``, or ``tool_call``; loss mask 1, its rollout
log-probs, the weight version that sampled it) and each span the environment appended (role
``observation`` or any other string: loss mask 0, rollout log-prob 0.0, version -1). A :class:`Turn`
groups the Parts of one model call with the environment's response to it; ``Turn.conditioning()`` is
exactly the Parts the engine was given for that call. Every model turn also leaves a
:class:`RequestRecord` (timing on one wall clock, engine worker, served version), which trace
exporters and metrics read. ``Sample.segments`` / :class:`Segment` (model vs observation spans) are
the pre-Part accessors: they still work, with a ``DeprecationWarning`` issued once per process.

Plain Python lists here (not tensors): samples cross process boundaries (Ray, vLLM workers) and are
small next to the model. Tensors are built once per micro-batch by :mod:`unirl.packing`.
No torch import at module load.
"""

from __future__ import annotations

import hashlib
import math
import random
import warnings
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from unirl.kernel.errors import SampleError
from unirl.sample_parts import (  # noqa: F401 - re-exported: the pieces of a sample
    MODEL_ROLES,
    NO_VERSION,
    OBSERVATION_LOGPROB,
    PROMPT_ROLE,
    GroupLayer,
    Part,
    RequestRecord,
    Segment,
    SegmentKind,
    Span,
    Turn,
    fork_id,
    fork_point,
    now_ms,
    trains,
)

Status = Literal["pending", "ok", "truncated", "failed"]

_SEGMENTS_WARNED = False


def _warn_segments() -> None:
    global _SEGMENTS_WARNED
    if not _SEGMENTS_WARNED:
        _SEGMENTS_WARNED = True
        warnings.warn("Sample.segments is deprecated: use Sample.parts (roles, log-probs, versions) or "
                      "Sample.spans (offsets); it will be removed in the next release",
                      DeprecationWarning, stacklevel=3)


@dataclass
class Sample:
    """One prompt (root) or one generated trajectory (child).

    ``response_ids``, ``loss_mask``, ``rollout_logprobs`` and ``versions`` are aligned token by token.
    ``loss_mask`` is 0 for tokens the policy did not choose (tool observations). ``versions[i]`` is the
    weight version of the policy that sampled token i. ``reward`` is NaN for a *failed* trajectory (an
    infrastructure fault): it is excluded from its group's statistics and gets zero advantage.
    ``spans`` cover the response in order (the Parts, :attr:`parts`, are a view over them and the flat
    lists); ``requests`` hold one record per model turn.
    ``finish_reason`` is the last turn's: "stop", "length", "abort" (cut off by ``engine.abort()``,
    what was generated so far kept) or "error".
    """

    id: str
    prompt_ids: list[int]
    prompt_text: str = ""
    answer: Any = None
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "stop" | "length" | "abort" | "error"
    status: Status = "pending"
    reward: float = math.nan
    seed: int | None = None
    response_text: str = ""
    spans: list[Span] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    routing: Any = None  # R3: int16 numpy [response tokens, layers, k] expert ids, or None (unirl.routing)

    # ---------------------------------------------------------------- lineage
    @property
    def parent_id(self) -> str:
        return self.id.rpartition("/")[0]

    @property
    def group_id(self) -> str:
        """The GRPO group: siblings of one launch share it, at any turn depth (first path component)."""
        return self.id.partition("/")[0]

    @property
    def prompt_id(self) -> str:
        """The dataset prompt this sample came from, without the launch tag (``p17``)."""
        return self.group_id.partition("@")[0]

    @property
    def depth(self) -> int:
        return self.id.count("/")

    @property
    def fork_group_id(self) -> str:
        """Siblings branched from the same point (``p17@train-3/0/f2``; see the module doc). A sample
        that is not a fork branch is a branch of its launch: its ``group_id``."""
        fp = fork_point(self.id)
        if fp is None:
            return self.group_id
        return f"{fp[0]}/f{fp[1]}"

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

    def fork(self, branch: int) -> Sample:
        """Branch ``branch`` of a fork of this trajectory taken where it stands, before its next model
        turn (turn ``self.turns``): a child with id ``fork_id(self.id, self.turns, branch)`` whose Parts
        are this sample's (the shared prefix: prompt, every turn and observation so far, the request
        records of those turns), to be continued on its own.

        Why no ``at_turn`` into the past: a sample keeps its text as one string without per-Part offsets,
        so an earlier cut could not be made exactly; fork the snapshot taken at that boundary instead
        (the agentic controller keeps one per turn). Why no sampling parameters here: on every engine they
        belong to a submission (``engine.submit(samples, sampling)``), so branches that should sample
        differently are submitted with their own :class:`~unirl.contracts.SamplingParams`.

        **Prefix sharing.** Branches of one fork have equal ``context_ids``. Submitted together, the
        embedded engine prefills that context once and fans its KV cache out to every branch
        (:meth:`TorchEngine._shared_prefill`; the branches' ``RequestRecord.cached_tokens`` say so); vLLM
        gets identical prompt token ids, so its prefix cache serves the context's full KV blocks
        (``enable_prefix_caching``; docs/agentic.md).

        **Seeds.** A seeded parent gives each branch ``stable_seed(seed, "f{turn}.{branch}")``: branches
        draw differently, and a branch draws the same tokens wherever and whenever it runs. Unseeded, the
        engine draws a seed per request as usual."""
        if self.status == "failed":
            raise SampleError(f"sample {self.id} failed ({self.meta.get('error', '')}); a failed trajectory "
                              "cannot be forked")
        at = self.turns
        child = self.copy()
        child.id = fork_id(self.id, at, branch)
        child.reward = math.nan
        if self.seed is not None:
            child.seed = stable_seed(self.seed, f"f{at}.{branch}")
        return child

    # ---------------------------------------------------------------- building a trajectory
    @property
    def turns(self) -> int:
        """Model turns generated so far."""
        return 1 + max((sp.turn for sp in self.spans if sp.role in MODEL_ROLES), default=-1)

    @property
    def context_ids(self) -> list[int]:
        """What a continuation conditions on: the prompt plus every earlier turn and observation."""
        return self.prompt_ids + self.response_ids

    def turn_seed(self) -> int | None:
        """The sampling seed of the next model turn: keyed on the request (its seed and how far the
        trajectory got), never on the batch or the step, so a request samples the same tokens anywhere."""
        if self.seed is None:
            return None
        return self.seed if not self.response_ids else stable_seed(self.seed, len(self.response_ids))

    def append_model_turn(self, token_ids: Sequence[int], logprobs: Sequence[float], version: int,
                          finish_reason: str, *, text: str = "", role: str = "model") -> None:
        """Append one model turn (loss mask 1) and set status from its finish reason. ``role`` is one of
        :data:`MODEL_ROLES` (``tool_call`` for a turn known to call a tool, as a demonstration is).

        "stop" -> ok, "length" -> truncated, "abort" -> truncated (partial, still trainable), other -> failed.
        """
        if len(logprobs) != len(token_ids):
            raise SampleError(f"sample {self.id}: {len(token_ids)} new tokens but {len(logprobs)} log-probs")
        if role not in MODEL_ROLES:
            raise SampleError(f"sample {self.id}: a model turn's role must be one of {sorted(MODEL_ROLES)}, got {role!r}")
        self.append_part(Part(role, list(token_ids), list(logprobs), int(version), turn=self.turns))
        self.response_text += text
        self.finish_reason = finish_reason
        if finish_reason == "stop":
            self.status = "ok"
        elif finish_reason in ("length", "abort"):
            self.status = "truncated"
        else:
            self.mark_failed(f"engine finished with {finish_reason!r}")

    def mark_last_turn(self, role: str) -> None:
        """Re-role the last model turn's Parts as ``role`` (one of :data:`MODEL_ROLES`). Why after the
        fact: the engine appends a turn as ``model``; only the environment, parsing it, knows it called a
        tool (``tool_call``). The loss mask does not change: both roles are the model's own tokens."""
        if role not in MODEL_ROLES:
            raise SampleError(f"sample {self.id}: a model turn's role must be one of {sorted(MODEL_ROLES)}, got {role!r}")
        last = self.turns - 1
        if last < 0:
            raise SampleError(f"sample {self.id}: no model turn to mark as {role!r}")
        self.spans = [replace(sp, role=role) if sp.turn == last and sp.role in MODEL_ROLES else sp for sp in self.spans]

    def append_observation(self, token_ids: Sequence[int], *, text: str = "", tool_ms: float | None = None) -> None:
        """Append an environment observation: loss mask 0, log-prob ``OBSERVATION_LOGPROB``, no version.

        ``tool_ms``: how long the environment / tool took to answer the last model turn (the caller
        measured it); kept on that turn's :class:`RequestRecord` so a trace can split the wait before the
        next turn into tool time and controller overhead."""
        if tool_ms is not None and self.requests:
            self.requests[-1].tool_ms = round(float(tool_ms), 3)
        self.append_part(Part("observation", list(token_ids), turn=max(self.turns - 1, 0)))
        self.response_text += text

    def append_part(self, part: Part) -> None:
        """Append one response Part to the flat arrays; its loss mask comes from its role. A model Part
        needs one log-prob per token; any other Part gets log-prob ``OBSERVATION_LOGPROB`` and no
        version. Status and text are the caller's (``append_model_turn`` sets them)."""
        if part.role == PROMPT_ROLE:
            raise SampleError(f"sample {self.id}: a '{PROMPT_ROLE}' Part is the prompt_ids, not a response Part")
        n, start = len(part.tokens), len(self.response_ids)
        self.response_ids.extend(int(t) for t in part.tokens)
        if part.trains:
            if part.logprobs is None or len(part.logprobs) != n:
                got = "none" if part.logprobs is None else len(part.logprobs)
                raise SampleError(f"sample {self.id}: a {part.role!r} Part of {n} tokens has {got} log-probs")
            self.loss_mask.extend([1] * n)
            self.rollout_logprobs.extend(float(x) for x in part.logprobs)
            self.versions.extend([int(part.version)] * n)
        else:
            self.loss_mask.extend([0] * n)
            self.rollout_logprobs.extend([OBSERVATION_LOGPROB] * n)
            self.versions.extend([NO_VERSION] * n)
        self.spans.append(Span(part.role, part.turn, start, start + n, part.payload))

    # ---------------------------------------------------------------- parts and turns (views)
    def _response_spans(self) -> list[Span]:
        """``spans``, or for a sample built without them (a warm start, a hand-made sample) the runs of
        its loss mask: 1 -> one model turn each, 0 -> an observation of the turn before."""
        if self.spans or not self.response_ids:
            return self.spans
        out: list[Span] = []
        turn, start = -1, 0
        for i in range(1, len(self.loss_mask) + 1):
            if i == len(self.loss_mask) or self.loss_mask[i] != self.loss_mask[start]:
                if self.loss_mask[start]:
                    turn += 1
                    out.append(Span("model", turn, start, i))
                else:
                    out.append(Span("observation", turn, start, i))
                start = i
        return out

    @property
    def parts(self) -> list[Part]:
        """The content as Parts, in order: the prompt, then every response span.

        A view computed from the flat per-token lists (``response_ids``, ``rollout_logprobs``,
        ``versions``) and ``spans``, not stored: the hot path (packing, losses, engines) reads the flat
        lists, and a sample that crosses processes carries each token once. Building it slices lists
        (O(tokens)); call it once per use, not per token. ``Sample.from_parts(s.id, s.parts)`` rebuilds
        the same flat lists and spans (the round trip is tested)."""
        out = [Part(PROMPT_ROLE, list(self.prompt_ids))]
        for sp in self._response_spans():
            if sp.role in MODEL_ROLES:
                lps = self.rollout_logprobs[sp.start:sp.end]
                # a hand-built or warm-start sample may carry no versions (or log-probs): no version then
                ver = self.versions[sp.start] if sp.start < min(sp.end, len(self.versions)) else NO_VERSION
            else:
                lps, ver = None, NO_VERSION
            out.append(Part(sp.role, self.response_ids[sp.start:sp.end], lps, ver, sp.turn, sp.payload))
        return out

    def role_mask(self) -> list[int]:
        """The loss mask derived from the Parts' roles (1 for model-produced tokens). Equals
        ``loss_mask`` as the rollout wrote it; a shaping step may zero ``loss_mask`` later (e.g. a
        filtered sample), never the roles."""
        return [int(p.trains) for p in self.parts[1:] for _ in p.tokens]

    def turn_list(self) -> list[Turn]:
        """The model turns in order. Turn k holds its model Part(s) and the environment Parts after
        them up to turn k+1's call; environment content before the first call belongs to no turn
        (it is conditioning only)."""
        parts = self.parts
        spans = [Span(PROMPT_ROLE, -1, 0, 0), *self._response_spans()]
        out: list[Turn] = []
        first: dict[int, int] = {}  # turn -> index of its first model Part
        for i, p in enumerate(parts):
            if p.trains and p.turn not in first:
                first[p.turn] = i
        order = sorted(first.items(), key=lambda kv: kv[1])
        for j, (k, i) in enumerate(order):
            stop = order[j + 1][1] if j + 1 < len(order) else len(parts)
            out.append(Turn(index=k, parts=parts[i:stop], start=spans[i].start,
                            end=spans[stop - 1].end if stop > i else spans[i].start, context=parts[:i]))
        return out

    def turn(self, k: int) -> Turn:
        """Model turn ``k`` (see :meth:`turn_list`)."""
        for t in self.turn_list():
            if t.index == k:
                return t
        raise SampleError(f"sample {self.id} has no turn {k} ({self.turns} model turns)")

    @classmethod
    def from_parts(cls, id: str, parts: Sequence[Part], **fields: Any) -> Sample:
        """A sample whose content is ``parts`` (the first one the prompt); the flat lists are written
        from them. ``fields`` sets the rest (status, reward, answer, ...)."""
        if not parts or parts[0].role != PROMPT_ROLE:
            raise SampleError(f"sample {id}: the first Part must have role '{PROMPT_ROLE}'")
        s = cls(id=id, prompt_ids=list(parts[0].tokens), **fields)
        for p in parts[1:]:
            s.append_part(p)
        return s

    # ---------------------------------------------------------------- deprecated segment accessors
    @property
    def segments(self) -> list[Segment]:
        """Deprecated: the spans as model / observation :class:`Segment` (warns once per process).

        The same Segment objects come back while the spans are unchanged (old code compares them by
        identity, ``seg is s.segments[-1]``); a fresh list each time, as before."""
        _warn_segments()
        cached = self.__dict__.get("_segments_view")
        if cached is None or cached[0] != self.spans:
            segs = [Segment("model" if sp.role in MODEL_ROLES else "observation", sp.turn, sp.start, sp.end)
                    for sp in self.spans]
            cached = (list(self.spans), segs)
            self.__dict__["_segments_view"] = cached
        return list(cached[1])

    @segments.setter
    def segments(self, value: Sequence[Segment]) -> None:
        _warn_segments()
        self.spans = [Span(seg.kind, seg.turn, seg.start, seg.end) for seg in value]

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

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle, also a Sample pickled before Parts existed (a checkpoint's carried tail, written
        with a ``segments`` field and no ``spans``): its segments become the spans, so a run
        checkpointed by an older release resumes."""
        state = dict(state)
        if "spans" not in state:
            state["spans"] = [Span(seg.kind, seg.turn, seg.start, seg.end) for seg in state.pop("segments", [])]
        self.__dict__.update(state)

    def copy(self) -> Sample:
        return replace(
            self,
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            loss_mask=list(self.loss_mask),
            rollout_logprobs=list(self.rollout_logprobs),
            versions=list(self.versions),
            spans=list(self.spans),
            requests=[replace(r) for r in self.requests],
            meta=dict(self.meta),
        )

    def validate(self, source: str = "") -> None:
        """Raise :class:`SampleError` naming this sample (and ``source``, the engine) when the output is
        malformed: misaligned per-token lists, segments that do not tile the response, masks or
        log-probs that contradict a segment's kind, non-finite or positive log-probs."""
        by = f" from {source}" if source else ""

        def bad(why: str) -> SampleError:
            return SampleError(f"sample {self.id}{by} is malformed: {why}")

        n = len(self.response_ids)
        for name in ("loss_mask", "rollout_logprobs", "versions"):
            got = len(getattr(self, name))
            if got != n:
                raise bad(f"{name} has {got} entries for {n} response tokens")
        if self.status == "pending":
            raise bad("status is still 'pending' (the engine returned it without generating)")
        pos = 0
        for sp in self.spans:
            if sp.start != pos or sp.end < sp.start:
                raise bad(f"segment {sp} does not start where the previous one ended ({pos})")
            want = 1 if sp.role in MODEL_ROLES else 0
            if any(self.loss_mask[i] != want for i in range(sp.start, sp.end)):
                kind = "model" if want else "observation"
                raise bad(f"{kind} segment {sp.start}:{sp.end} must have loss_mask {want}")
            pos = sp.end
        if self.spans and pos != n:
            raise bad(f"segments cover {pos} of {n} response tokens")
        for i, (lp, m) in enumerate(zip(self.rollout_logprobs, self.loss_mask, strict=True)):
            if m and not (lp <= 0.0):  # also catches NaN
                raise bad(f"rollout_logprobs[{i}] = {lp} is not a log-probability (finite, <= 0)")


def launch(prompt: Sample, tag: str) -> Sample:
    """The root of one launch of ``prompt``: id ``p17@tag`` (unique per launch when ``tag`` is)."""
    if "@" in prompt.id or "/" in prompt.id:
        raise SampleError(f"prompt id {prompt.id!r} may not contain '@' or '/' (they carry lineage)")
    if not tag or "/" in tag or "@" in tag:
        raise SampleError(f"launch tag {tag!r} must be non-empty, without '/' or '@'")
    root = replace(prompt, id=f"{prompt.id}@{tag}", meta=dict(prompt.meta))
    return root


def expand(prompts: Iterable[Sample], n: int, *, tag: str, base_seed: int | None = None,
           seed_tag: str | None = None) -> list[Sample]:
    """Launch each prompt under ``tag`` and make its n generation slots, seeded per request.

    ``tag`` must be unique per launch within a run (the trainer uses ``train-{step}`` and
    ``eval-{step}``; async controllers a counter). A slot's seed is ``stable_seed(base_seed, id)``:
    it depends on the request alone, so a resumed run samples exactly what the uninterrupted run
    would have, whatever the batch composition or arrival order. ``seed_tag`` replaces ``tag`` in the
    seed only: held-out evaluation launches get fresh ids but the same seeds every time, so evals at
    different steps compare like with like.
    """
    out = []
    for p in prompts:
        root = launch(p, tag)
        for i in range(n):
            child = root.child(i)
            if base_seed is not None:
                child.seed = stable_seed(base_seed, f"{p.id}@{seed_tag or tag}/{i}")
            out.append(child)
    return out


#: held-out evaluation samples under seeds of their own, apart from the training stream's
EVAL_SEED_OFFSET = 7919


def eval_seed(run_seed: int) -> int:
    """The base seed of every held-out evaluation (the in-training eval, ``unirl eval``, the eval
    controller): one derivation, so an eval of the same model at the same step draws the same samples
    wherever it runs."""
    return run_seed + EVAL_SEED_OFFSET


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
