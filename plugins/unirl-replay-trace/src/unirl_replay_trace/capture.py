"""Turn scored rollout batches into trace rows: what the predictor may see, and what was measured.

Why two kinds of rows: a replay predicts service times (queueing, prefill, decode) from a workload.
If a measured service time leaked into the workload (a child turn's measured arrival, a first-token
time), the "prediction" would partly be the answer. So every :class:`~unirl.api.Sample` turn becomes

* a **workload** row (predictor input): ids, group, trajectory, turn order, the dependency on the
  previous turn and the *external* wait before this turn (tool / environment time, not service),
  token lengths, chained prefix block hashes, the served weight version;
* an **outcome** row (measured, never given to the predictor): submit, first token and finish times
  relative to the batch barrier, the engine worker, the finish reason.

Request ids: ``<sample id>:<turn>`` (``p17@train-3/0:0`` is the first turn of sibling 0 of launch
``train-3`` of prompt ``p17``). A branch sample (``p17@train-3/0/1``) that was copied from its parent
carries the parent's earlier request records; those leading records are recognised as the parent's
(equal :class:`RequestRecord`) and keep the parent's request id, so one model call is one request
however many Sample rows hold it. Only the branch's own turns get new ids.

Forks (``Sample.fork``, ``rollout.branching``): a branch ``p17@train-3/0/f1.2`` replaced its parent
``p17@train-3/0``, which is therefore in no batch. The parent's turns before the fork (the branches'
shared prefix, equal records in every branch) become the requests of the parent trajectory, emitted
once under its id (``p17@train-3/0:0``); each branch's own turns depend on the parent's last one, as a
copied branch's do. Every workload row says where its trajectory sits in the tree: ``fork`` is
``{"parent", "at_turn", "branch"}`` (:func:`unirl.api.fork_point` of its id) or null.

Waits: the wait before turn k is ``submitted(k) - finished(k-1)`` on the one clock
(:func:`unirl.api.now_ms`). ``0.0`` is a measured zero wait; ``None`` means it was not measured
(a time was never reached), which exporters must not read as zero. It is split into ``tool_ms`` (what
the environment / tool took, as the controller measured it: ``RequestRecord.tool_ms`` of turn k-1)
and ``overhead_ms`` (the rest: controller scheduling, tokenizing, queueing); both ``None`` when the
controller did not measure tool time. The replay's delay is the whole wait (both are real time the
engine did not serve).

Arrivals: a request without a parent (a trajectory's first turn) carries ``arrival_ms``, its observed
submit time from the barrier. It is a workload input, not a service time, for a batch submitted at
once; a controller that launches trajectories as slots free up makes it depend on earlier service, so
the replay can also put every first turn at the barrier (``--arrivals barrier``).

Initial cache state: each batch records what the engine's prefix cache held when the batch's first
request was submitted (``RequestRecord.cache_tokens_at_submit``): ``empty``, ``warm`` with N tokens
(vLLM reports an upper bound: tokens served since its last reset), or ``unknown``. A Dynamo replay
starts cold, so a warm batch is flagged in the report.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field, replace
from typing import Any

from unirl.api import Sample, fork_point
from unirl_replay_trace.content import content_row

#: trace schema, bumped on any incompatible change of the rows or the manifest
SCHEMA = "unirl.rollout_trace"
SCHEMA_VERSION = 3
#: schema versions this code reads (2 added arrival_ms, tool_ms / overhead_ms, initial_cache; 3 added the
#: workload's ``fork`` and the content rows' Parts (:mod:`unirl_replay_trace.content`); all optional)
READABLE_SCHEMA_VERSIONS = (1, 2, 3)
_HASH_MASK = (1 << 62) - 1


def block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """Chained hashes of ``tokens`` in blocks of ``block_size`` (the last block may be partial).

    Block i's hash covers block i *and* every block before it (the previous digest is hashed in), so
    two contexts share hash i exactly when they share their first ``(i+1) * block_size`` tokens: what
    a prefix cache can reuse. 62-bit integers (the Mooncake formats want integer ids); no token id
    is stored."""
    out: list[int] = []
    prev = b""
    for i in range(0, len(tokens), block_size):
        d = hashlib.blake2b(prev + array("q", tokens[i:i + block_size]).tobytes(), digest_size=8).digest()
        out.append(int.from_bytes(d, "little") & _HASH_MASK)
        prev = d
    return out


@dataclass
class Batch:
    """One rollout batch (one ``record`` call): the barrier every replayed batch starts from."""

    index: int
    phase: str
    step: int
    version: int
    fingerprint: str | None
    barrier_unix_ms: float
    workload: list[dict[str, Any]] = field(default_factory=list)
    outcomes: list[dict[str, Any]] = field(default_factory=list)
    content: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    initial_cache: dict[str, Any] = field(default_factory=lambda: {"state": "unknown"})

    def meta(self) -> dict[str, Any]:
        groups = {w["group_id"] for w in self.workload}
        trajectories = {w["trajectory_id"] for w in self.workload}
        return {"batch": self.index, "phase": self.phase, "step": self.step, "version": self.version,
                "fingerprint": self.fingerprint, "requests": len(self.workload), "groups": len(groups),
                "trajectories": len(trajectories), "initial_cache": self.initial_cache}


def initial_cache(records: list[Any]) -> dict[str, Any]:
    """The engine's prefix cache when the batch's first request was submitted (see the module doc)."""
    stamped = [r for r in records if r.submitted_ms > 0]
    if not stamped:
        return {"state": "unknown"}
    first = min(stamped, key=lambda r: r.submitted_ms)
    n = int(getattr(first, "cache_tokens_at_submit", -1))
    if n < 0:
        return {"state": "unknown", "engine": first.engine}
    return {"state": "empty" if n == 0 else "warm", "prefix_tokens": n, "engine": first.engine}


def fork_parents(samples: list[Any]) -> list[Any]:
    """The fork parents of ``samples`` that are not among them (a fork replaces its parent), rebuilt from
    a branch: its Parts before the fork turn and the request records of those turns (every branch of
    one fork holds equal ones). Nested forks give their parents' parents too."""
    have = {s.id for s in samples}
    out: list[Any] = []
    todo = list(samples)
    while todo:
        s = todo.pop()
        fp = fork_point(s.id)
        if fp is None or fp[0] in have:
            continue
        parent_id, at, _ = fp
        parts = [p for p in s.parts if p.turn < at]  # the prompt (-1), turns before the fork, their answers
        parent = Sample.from_parts(parent_id, parts, prompt_text=s.prompt_text, seed=None)
        parent.requests = [replace(r) for r in s.requests[:at]]
        have.add(parent_id)
        out.append(parent)
        todo.append(parent)
    return out


def _fork(sample_id: str) -> dict[str, Any] | None:
    fp = fork_point(sample_id)
    return None if fp is None else {"parent": fp[0], "at_turn": fp[1], "branch": fp[2]}


def _rel(t: float, barrier: float) -> float | None:
    return None if t <= 0.0 else round(t - barrier, 3)


def _inherited_turns(s: Any, by_id: dict[str, Any], rid: dict[tuple[str, int], str],
                     problems: list[str]) -> int | None:
    """How many of branch ``s``'s first turns are its parent's (their request ids, shared, go into
    ``rid``); None when they cannot be mapped (the parent is not in the batch, or was itself rejected),
    with the reason in ``problems``."""
    parent = by_id.get(s.parent_id)
    if parent is None:
        problems.append(f"sample {s.id} is a branch of {s.parent_id}, which is not in the same "
                        "rollout batch: its inherited turns cannot be mapped to request ids")
        return None
    inherited = 0
    while (inherited < min(len(s.requests), len(parent.requests))
           and s.requests[inherited] == parent.requests[inherited]
           and (parent.id, inherited) in rid):  # absent when the parent itself was rejected
        rid[(s.id, inherited)] = rid[(parent.id, inherited)]
        inherited += 1
    if inherited < len(parent.requests) and inherited < len(s.requests) \
            and s.requests[inherited] == parent.requests[inherited]:
        problems.append(f"sample {s.id}: its parent {parent.id} could not be mapped, so its "
                        "inherited turns cannot be either")
        return None
    return inherited


def _wait_split(prev: Any, rec: Any, request_id: str,
                problems: list[str]) -> tuple[float | None, float | None, float | None]:
    """The wait between the previous turn's finish and this request's submit, and the measured tool time
    and controller overhead inside it (None where a time is missing)."""
    wait = tool = overhead = None
    if prev.finished_ms > 0 and rec.submitted_ms > 0:
        wait = round(rec.submitted_ms - prev.finished_ms, 3)
        if wait < 0:
            problems.append(f"request {request_id}: submitted {-wait} ms before its previous "
                            "turn finished (negative wait: records from two clocks?)")
        measured_tool = getattr(prev, "tool_ms", -1.0)
        if measured_tool >= 0:  # tool time is inside the wait; clamp a clock-read rounding
            tool = round(min(measured_tool, max(wait, 0.0)), 3)
            overhead = round(wait - tool, 3)
    return wait, tool, overhead


def capture_batch(samples: list[Any], *, index: int, phase: str, step: int, version: int,
                  fingerprint: str | None, block_size: int, include_content: bool = False) -> Batch:
    """Rows for one scored batch. Never raises for odd data: what an exporter cannot represent is
    listed in ``problems`` (and rejected at export), so a trace never stops a training run midway."""
    records = [r for s in samples for r in s.requests]
    submitted = [r.submitted_ms for r in records if r.submitted_ms > 0]
    barrier = min(submitted) if submitted else 0.0
    batch = Batch(index, phase, step, int(version), fingerprint, barrier, initial_cache=initial_cache(records))
    scored = {s.id for s in samples}
    everyone = list(samples) + fork_parents(list(samples))
    by_id = {s.id: s for s in everyone}
    rid: dict[tuple[str, int], str] = {}  # (sample id, turn) -> request id (shared by branches)
    for s in sorted(everyone, key=lambda s: (s.depth, s.id)):
        inherited = _inherited_turns(s, by_id, rid, batch.problems) if s.depth > 1 else 0
        if inherited is None:
            continue
        model_segs = [(t.start, t.start + sum(len(p.tokens) for p in t.model_parts)) for t in s.turn_list()]
        if len(model_segs) != len(s.requests):
            batch.problems.append(f"sample {s.id} has {len(s.requests)} request records for {len(model_segs)} "
                                  "model turns (the engine must leave one RequestRecord per turn)")
            continue
        versions = sorted({r.version for r in s.requests})
        if len(versions) > 1:
            batch.problems.append(f"sample {s.id} spans weight versions {versions} (a partial rollout carried it "
                                  "across a weight sync): its earlier turns ran before this batch's barrier")
        context = s.prompt_ids + s.response_ids
        for k in range(inherited, len(s.requests)):
            rec, (seg_start, seg_end) = s.requests[k], model_segs[k]
            request_id = f"{s.id}:{k}"
            rid[(s.id, k)] = request_id
            parent_rid = rid.get((s.id, k - 1)) if k > 0 else None
            wait, tool, overhead = (_wait_split(s.requests[k - 1], rec, request_id, batch.problems) if k > 0
                                    else (None, None, None))
            n_in = len(s.prompt_ids) + seg_start
            if rec.prompt_tokens and rec.prompt_tokens != n_in:
                batch.problems.append(f"request {request_id}: engine counted {rec.prompt_tokens} input tokens, "
                                      f"the sample's context before the turn has {n_in}")
            if rec.finish_reason == "abort" or (s.finish_reason == "abort" and k == len(s.requests) - 1):
                batch.problems.append(f"request {request_id} was aborted (finish_reason 'abort'): its length was "
                                      "cut by an external event that a replay cannot model")
            elif rec.finished_ms <= 0 or rec.submitted_ms <= 0:
                # a missing first-token time is allowed (SGLang without --enable-metrics): TTFT is then not
                # compared for that request; a missing finish or submit leaves nothing to compare
                batch.problems.append(f"request {request_id} has no measured submit / finish time "
                                      f"(finish_reason {rec.finish_reason or s.finish_reason!r})")
            if seg_end == seg_start:
                batch.problems.append(f"request {request_id} generated no tokens; a replay needs output_length >= 1")
            batch.workload.append({
                "request_id": request_id, "sample_id": s.id, "group_id": s.group_id, "trajectory_id": s.id,
                "turn": k, "parent_request_id": parent_rid, "wait_ms": wait, "tool_ms": tool, "overhead_ms": overhead,
                "arrival_ms": _rel(rec.submitted_ms, barrier) if parent_rid is None else None, "batch": index,
                "input_length": n_in, "output_length": seg_end - seg_start,
                "hash_ids": block_hashes(context[:n_in], block_size), "version": rec.version,
                "fork": _fork(s.id),
            })
            batch.outcomes.append({
                "kind": "request", "request_id": request_id, "batch": index,
                "submitted_ms": _rel(rec.submitted_ms, barrier), "first_token_ms": _rel(rec.first_token_ms, barrier),
                "finished_ms": _rel(rec.finished_ms, barrier), "engine": rec.engine, "worker": rec.worker,
                "new_tokens": rec.new_tokens, "cached_tokens": getattr(rec, "cached_tokens", -1),
                "finish_reason": rec.finish_reason or (s.finish_reason if k == len(s.requests) - 1 else ""),
            })
        if include_content and s.id in scored:  # a rebuilt fork parent is in the workload, not the batch
            batch.content.append(content_row(s))
    batch.outcomes.append({"kind": "batch", "batch": index, "barrier_unix_ms": barrier})
    return batch
