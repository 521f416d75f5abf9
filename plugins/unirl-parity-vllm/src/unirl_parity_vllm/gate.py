"""The parity gate: ``unirl_before_backward``, on every micro-batch, before any gradient exists.

For the micro-batch's model tokens (``loss_mask`` 1) it checks shapes, dtype (fp32) and finiteness
of the trainer's selected-token log-probs and the engine's, then compares them with
``torch.equal``. No tolerance: one differing bit is a mismatch. On a mismatch it raises
:class:`ParityMismatchError` with the mismatch count, max |diff| and the k3 KL estimate; a
multi-rank actor (FSDP) makes every rank raise together (``ActorSkeleton._agree``), so no rank is left
inside a collective and no optimizer step is taken.

Only update 0 of a trainer step is on-policy (the engine sampled with exactly the weights the actor
holds): later updates of ``algorithm.updates_per_batch > 1`` are compared against a moved policy by
construction, so the profile requires ``updates_per_batch: 1`` and the gate skips (and counts) any
later update instead of failing it.

For a Mixture-of-Experts model it also compares the *routing*: the top-k expert set the engine used
for each loss token (``meta["parity_routing"]``, see :mod:`~unirl_parity_vllm.routing`) against the
one this micro-batch's forward used (the recorder the ``qwen3_moe`` provider keeps open around it),
and counts expert load per layer; recorded per phase and per trainer step, never raised on (the
log-prob check is the gate; a routing flip always shows there too).

Every call records its numbers per phase (``initial_checkpoint`` for trainer step 0, whose rollout
used the initial publish; ``post_update_reload`` for later steps, whose rollout used weights that
went through >= 1 optimizer step and a weight sync) in ``<run dir>/parity/gate-rank<r>.json``
(atomic), which the trainer-side :mod:`~unirl_parity_vllm.artifact` recorder merges.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from unirl.api import UniRLError
from unirl_parity_vllm.paths import DIR_ENV, parity_dir, write_json_atomic  # noqa: F401 - DIR_ENV re-exported

#: |diff| histogram: bin 0 counts exact zeros, bin i>0 counts 10**(LOW+i-1) <= |diff| < 10**(LOW+i)
HIST_LOW, HIST_BINS = -12, 13


class ParityMismatchError(UniRLError):
    """Rollout and replay log-probs differ (or are malformed); the step is stopped before backward."""

    def __init__(self, message: str, stats: dict[str, Any]):
        super().__init__(message)
        self.stats = stats

    def __reduce__(self):
        # an FSDP rank's gate failure crosses Ray to the driver: pickle (message, stats), not just args
        return type(self), (self.args[0], self.stats), self.__dict__


def phase_of(rl_step: int) -> str:
    return "initial_checkpoint" if rl_step == 0 else "post_update_reload"


def _hist(diff) -> list[int]:
    import torch

    d = diff.abs().double()
    out = [int((d == 0).sum())]
    nz = d[d > 0]
    logs = torch.floor(torch.log10(nz)).clamp(HIST_LOW, HIST_LOW + HIST_BINS - 2) - HIST_LOW
    counts = torch.bincount(logs.long(), minlength=HIST_BINS - 1) if nz.numel() else torch.zeros(HIST_BINS - 1)
    return out + [int(c) for c in counts.tolist()]


def compare(logprobs, rollout_logprobs, mask) -> dict[str, Any]:
    """The gate's numbers for one micro-batch (raises :class:`ParityMismatchError` on malformed input)."""
    import torch

    problems = []
    if logprobs.shape != rollout_logprobs.shape or logprobs.shape != mask.shape:
        problems.append(f"shapes differ: replay {tuple(logprobs.shape)}, rollout {tuple(rollout_logprobs.shape)}, "
                        f"loss_mask {tuple(mask.shape)}")
    for name, t in (("replay", logprobs), ("rollout", rollout_logprobs)):
        if t.dtype != torch.float32:
            problems.append(f"{name} log-probs are {t.dtype}, not torch.float32")
    if problems:
        raise ParityMismatchError("parity gate: " + "; ".join(problems), {"malformed": problems})
    a, b = logprobs[mask], rollout_logprobs[mask]
    for name, t in (("replay", a), ("rollout", b)):
        if not bool(torch.isfinite(t).all()):
            problems.append(f"{name} log-probs have {int((~torch.isfinite(t)).sum())} non-finite values")
    if problems:
        raise ParityMismatchError("parity gate: " + "; ".join(problems), {"malformed": problems})
    diff = (a.double() - b.double())
    n = int(a.numel())
    r = a.double() - b.double()  # log(pi_train / pi_rollout) per token
    k3 = float((torch.exp(r) - 1 - r).mean()) if n else 0.0
    return {
        "tokens": n,
        "mismatches": int((a != b).sum()),
        "equal": bool(torch.equal(a, b)),
        "max_abs_diff": float(diff.abs().max()) if n else 0.0,
        "k3": k3,
        "hist": _hist(diff),
    }


class GateRecord:
    """Per-phase sums of one rank, persisted after every call."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, Any] = {"phases": {}, "skipped_updates": 0, "calls": 0}

    def add_routing(self, phase: str, rl_step: int, stats: dict[str, Any]) -> None:
        """Routing counts of one micro-batch (:func:`unirl_parity_vllm.routing.compare`), per phase and step."""
        from unirl_parity_vllm.routing import merge

        phases = self.data.setdefault("routing", {})
        phases[phase] = merge(phases.get(phase), stats)
        steps = self.data.setdefault("routing_steps", {})
        steps[str(rl_step)] = merge(steps.get(str(rl_step)), stats)

    def add(self, phase: str, stats: dict[str, Any], *, rl_step: int, versions: list[int]) -> None:
        p = self.data["phases"].setdefault(phase, {
            "tokens": 0, "mismatches": 0, "max_abs_diff": 0.0, "k3_sum": 0.0, "micro_batches": 0,
            "steps": [], "weight_versions": [], "hist": [0] * HIST_BINS, "failed": 0})
        p["tokens"] += stats["tokens"]
        p["mismatches"] += stats["mismatches"]
        p["max_abs_diff"] = max(p["max_abs_diff"], stats["max_abs_diff"])
        p["k3_sum"] += stats["k3"] * stats["tokens"]
        p["micro_batches"] += 1
        p["failed"] += 0 if stats["equal"] else 1
        if rl_step not in p["steps"]:
            p["steps"].append(rl_step)
        for v in versions:
            if v not in p["weight_versions"]:
                p["weight_versions"].append(v)
        p["hist"] = [x + y for x, y in zip(p["hist"], stats["hist"], strict=True)]
        self.data["calls"] += 1
        self.save()

    def skip(self) -> None:
        self.data["skipped_updates"] += 1
        self.save()

    def save(self) -> None:

        write_json_atomic(self.path, self.data)


_RECORDS: dict[str, GateRecord] = {}


def record_for(config: Any, rank: int) -> GateRecord:
    path = parity_dir(config) / f"gate-rank{rank}.json"
    rec = _RECORDS.get(str(path))
    if rec is None:
        rec = _RECORDS[str(path)] = GateRecord(path)
    return rec


def reset(config: Any) -> None:
    """Forget this process's gate records for the run (a fresh run in the same directory)."""
    base = str(parity_dir(config))
    for key in [k for k in _RECORDS if k.startswith(base)]:
        del _RECORDS[key]


def check(ctx: Any, config: Any) -> None:
    """The ``unirl_before_backward`` gate (see the module doc)."""
    import torch

    if not ctx.samples:  # a padding micro-batch of a sharded actor: nothing to compare
        return
    rec = record_for(config, ctx.rank)
    if ctx.update != 0:
        rec.skip()
        return
    mask = torch.tensor([bool(m) for s in ctx.samples for m in (s.loss_mask or [1] * len(s.response_ids))],
                        dtype=torch.bool, device=ctx.logprobs.device)
    versions = sorted({int(v) for s in ctx.samples for v, m in zip(s.versions, s.loss_mask or [], strict=False)
                       if m})
    phase = phase_of(ctx.rl_step)
    _routing(rec, phase, ctx)
    try:
        stats = compare(ctx.logprobs, ctx.rollout_logprobs, mask)
    except ParityMismatchError as exc:
        stats = {"tokens": int(mask.sum()), "mismatches": int(mask.sum()), "equal": False,
                 "max_abs_diff": math.inf, "k3": math.inf, "hist": [0] * HIST_BINS}
        rec.add(phase, stats, rl_step=ctx.rl_step, versions=versions)
        raise ParityMismatchError(f"{exc} (rank {ctx.rank}, step {ctx.rl_step}, micro-batch {ctx.micro_batch})",
                                  exc.stats) from None
    rec.add(phase, stats, rl_step=ctx.rl_step, versions=versions)
    if not stats["equal"]:
        raise ParityMismatchError(
            f"parity gate ({phase}, step {ctx.rl_step}, micro-batch {ctx.micro_batch}, rank {ctx.rank}): "
            f"{stats['mismatches']} of {stats['tokens']} selected-token log-probs differ between rollout and "
            f"replay; max |diff| {stats['max_abs_diff']:.3g}, k3 KL {stats['k3']:.3g}. No backward was run. "
            "See docs/parity.md (profile violations, mixed kernels, an engine with different weights).",
            stats)


def _routing(rec: GateRecord, phase: str, ctx: Any) -> None:
    """Record the micro-batch's routing numbers when its forward ran under the MoE provider."""
    from unirl_parity_vllm import moe, routing

    replay = moe.active()
    if replay is None or not replay.calls:
        return
    stats = routing.compare(ctx.samples, replay.by_layer(), replay.num_experts)
    if stats is not None:
        rec.add_routing(phase, ctx.rl_step, stats)


def routing_summary(records: list[dict[str, Any]], step: int | None = None) -> dict[str, Any]:
    """Per phase (or for one trainer ``step``) the merged routing numbers of every rank."""
    from unirl_parity_vllm.routing import merge, summary

    if step is not None:
        merged = None
        for r in records:
            merged = merge(merged, r.get("routing_steps", {}).get(str(step)))
        return summary(merged) or {}
    phases: dict[str, Any] = {}
    for r in records:
        for name, x in r.get("routing", {}).items():
            phases[name] = merge(phases.get(name), x)
    return {name: summary(x) for name, x in phases.items()}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the per-rank records into per-phase totals."""
    phases: dict[str, Any] = {}
    skipped = 0
    for r in records:
        skipped += r.get("skipped_updates", 0)
        for name, p in r.get("phases", {}).items():
            q = phases.setdefault(name, {"tokens": 0, "mismatches": 0, "max_abs_diff": 0.0, "k3_sum": 0.0,
                                         "micro_batches": 0, "failed_micro_batches": 0, "steps": set(),
                                         "weight_versions": set(), "hist": [0] * HIST_BINS})
            q["tokens"] += p["tokens"]
            q["mismatches"] += p["mismatches"]
            q["max_abs_diff"] = max(q["max_abs_diff"], p["max_abs_diff"])
            q["k3_sum"] += p["k3_sum"]
            q["micro_batches"] += p["micro_batches"]
            q["failed_micro_batches"] += p.get("failed", 0)
            q["steps"].update(p["steps"])
            q["weight_versions"].update(p["weight_versions"])
            q["hist"] = [x + y for x, y in zip(q["hist"], p["hist"], strict=True)]
    for q in phases.values():
        q["k3"] = q.pop("k3_sum") / q["tokens"] if q["tokens"] else 0.0
        q["steps"] = sorted(q["steps"])
        q["weight_versions"] = sorted(q["weight_versions"])
        q["bit_equal_fraction"] = (1 - q["mismatches"] / q["tokens"]) if q["tokens"] else None
        q["passed"] = q["tokens"] > 0 and q["mismatches"] == 0 and q["failed_micro_batches"] == 0
    return {"phases": phases, "skipped_updates": skipped}


def load_records(directory: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(Path(directory).glob("gate-rank*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):  # pragma: no cover - written atomically; a torn file is a bug
            continue
    return out
