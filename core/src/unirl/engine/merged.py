"""Continuous batching for the embedded engine: queued jobs join a running batch between decode steps.

Why: in stream mode every launch is one job of one group, and a job run alone holds the engine until
its longest row ends, while the other launches wait in the queue; on a long tail of response lengths
most of the batch is then finished rows (stream measured 1.16x sync). Here the batch is a set of
**lanes** (one per job, :class:`unirl.engine.queued.JobLane`): after each decode step, rows that ended
leave the batch, a lane whose rows all ended is finished (its samples get their turns and ``poll`` hands
them back at once), and queued jobs that fit under ``rollout.options.batch_size`` are prefilled and
joined to the running rows (:meth:`FastDecoder.merge`: both caches right-aligned on one column, each
row keeping its own positions).

What stays as a job run alone (:meth:`TorchEngine._run`): per-request ``first_token_ms`` and
``finished_ms``, the lane's weight version on every token, ``should_stop`` per job (abort ends that
job's rows only; ``restart_running`` takes them out and requeues the job), seeded draws (each row draws with its own seed and its own step, so a seeded
request draws the same tokens in any batch), and a job that never meets another gets the very bits it
gets alone (same row order, prefill, row dropping; tested). Rows that share a batch with other jobs'
rows see other GEMM shapes, so their log-probs may differ from alone in the last bits (fp32: within
1e-5; tested), as rows of different batch sizes already did.

Not merged (run alone, in queue order): stop strings, R3 routing records, images, parity's module
attention, the hf decoder, and jobs larger than ``batch_size`` (:meth:`TorchEngine._can_merge`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from unirl.engine import rows
from unirl.engine.sampler import draw, sampling_logits
from unirl.samples import now_ms

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.engine.queued import JobFeed, JobLane
    from unirl.engine.torch_engine import TorchEngine


@dataclass
class _Row:
    """One live row on the host: its lane, its sample's index in the lane, and what it drew so far."""

    lane: _Lane
    index: int
    toks: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)


@dataclass
class _Lane:
    """A job in the batch: its rows left to end, and each row's result once it ended."""

    lane: JobLane
    left: int
    cached: list[int]
    results: dict[int, tuple[list[int], list[float], str, float]] = field(default_factory=dict)
    first_done: bool = False


class MergedBatch:
    """The device state of the running rows (see the module doc) and the host bookkeeping of their lanes."""

    def __init__(self, engine: TorchEngine, feed: JobFeed, first: JobLane) -> None:
        import torch

        self.e, self.feed = engine, feed
        self.sampling = first.sampling
        stop_ids = engine.eos_ids | set(self.sampling.stop_token_ids)
        if self.sampling.ignore_eos:
            stop_ids -= engine.eos_ids
        self.stop_ids = stop_ids
        self.stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=engine.device)
        self.banned = (torch.tensor(sorted(engine.eos_ids | stop_ids), dtype=torch.long, device=engine.device)
                       if self.sampling.min_new_tokens > 0 else None)
        self.rows: list[_Row] = []
        self.state: dict[str, Any] | None = None
        self.col = 0
        self.logits = self.seed = self.step = self.pos = self.lim = None
        self.size = engine.options.batch_size

    # ------------------------------------------------------------------ admission
    def admit(self, lanes: list[JobLane]) -> None:
        """Prefill the lanes' rows (their contexts sorted as a job alone sorts them) and join them."""
        import torch

        e, new, contexts, seeds, limits = self.e, [], [], [], []
        drawn = torch.randint(0, 1 << 62, (sum(len(x.samples) for x in lanes),), generator=e._generator).tolist()
        at = 0
        for jl in lanes:
            lane = _Lane(jl, 0, [0] * len(jl.samples))
            live = []
            for i, s in enumerate(jl.samples):
                limit = self.sampling.new_token_limit(s)
                ts = s.turn_seed()
                seed = ts if ts is not None else drawn[at + i]
                if limit <= 0:  # the response budget is spent: an empty turn
                    s.append_model_turn([], [], jl.version, "length")
                else:
                    live.append((i, seed, limit))
            at += len(jl.samples)
            first_seen: dict[tuple[int, ...], int] = {}
            for i, _, _ in live:
                first_seen.setdefault(tuple(jl.samples[i].context_ids), i)
            live.sort(key=lambda x: (len(jl.samples[x[0]].context_ids), first_seen[tuple(jl.samples[x[0]].context_ids)], x[0]))
            lane.left = len(live)
            for i, seed, limit in live:
                new.append(_Row(lane, i))
                contexts.append(jl.samples[i].context_ids)
                seeds.append(seed)
                limits.append(limit)
            if not live:
                self._finish_lane(lane)
        if new:
            self._join(new, contexts, seeds, limits)

    def _join(self, new: list[_Row], contexts: list[list[int]], seeds: list[int], limits: list[int]) -> None:
        import torch

        e, dev, N = self.e, self.e.device, max(limits)
        ids, pos, valid, plen = rows.left_pad(contexts, N, e.pad_id, dev)
        state = e._prefill(contexts, ids, pos, valid, N)
        for r, served in zip(new, rows.prefix_served(contexts, e._share(contexts)), strict=True):
            r.lane.cached[r.index] = served
        logits = state.pop("logits")
        seed = torch.tensor(seeds, dtype=torch.int64, device=dev)
        lim = torch.tensor(limits, dtype=torch.long, device=dev)
        step = torch.zeros(len(new), dtype=torch.int64, device=dev)
        if self.state is None:
            self.state, self.col, self.logits, self.seed, self.step, self.pos, self.lim = (
                state, ids.shape[1], logits, seed, step, plen, lim)
        else:
            need = int(torch.cat((self.lim - self.step, lim)).max())
            self.state, self.col = e.decoder.merge(self.state, self.col, state, ids.shape[1], need)
            self.logits = torch.cat((self.logits, logits))
            self.seed, self.step = torch.cat((self.seed, seed)), torch.cat((self.step, step))
            self.pos, self.lim = torch.cat((self.pos, plen)), torch.cat((self.lim, lim))
        self.rows.extend(new)

    # ------------------------------------------------------------------ one decode step
    def draw_step(self) -> torch.Tensor:
        """Draw each row's next token from the current logits; record it; end the rows that stop, hit
        their limit or whose job was aborted; finish lanes whose rows all ended. Returns the tokens."""
        import torch

        raw = self.logits.float()
        pick = raw
        if self.banned is not None:
            early = (self.step < self.sampling.min_new_tokens)[:, None]
            pick = torch.where(early, raw.index_fill(-1, self.banned, -math.inf), raw)
        x = sampling_logits(pick, self.sampling)
        tok = draw(x, self.sampling, self.seed, self.step)
        processed = self.e.config.rollout.logprobs == "processed"
        lp = torch.log_softmax(x if processed else raw, dim=-1).gather(-1, tok[:, None])[:, 0]
        self.step = self.step + 1
        stopped = torch.isin(tok, self.stop)
        ended = stopped | (self.step >= self.lim)
        toks, lps, stop_l, end_l = tok.tolist(), lp.tolist(), stopped.tolist(), ended.tolist()
        t = now_ms()  # every live row's token exists on the host now
        lanes = {id(r.lane): r.lane for r in self.rows if r.toks is not None}
        aborted = {k for k, lane in lanes.items() if lane.lane.should_stop()}
        for k in [k for k in aborted if lanes[k].lane.job.restart]:  # restart_running: leave, requeued
            for r in self.rows:
                if r.lane is lanes[k]:
                    r.toks = r.lps = None
            self.feed.requeue(lanes[k].lane)
        for r, k, p, st, en in zip(self.rows, toks, lps, stop_l, end_l, strict=True):
            if r.toks is None:  # ended earlier (or its job restarts), in the batch until it is compacted
                continue
            if not r.lane.first_done:
                for s in r.lane.lane.samples:
                    s.requests[-1].first_token_ms = t
                r.lane.first_done = True
            r.toks.append(k)
            r.lps.append(p)
            if en or id(r.lane) in aborted:
                reason = "stop" if st else "length" if en else "abort"
                self._end_row(r, reason, t)
        return tok

    def _end_row(self, r: _Row, reason: str, t: float) -> None:
        r.lane.results[r.index] = (r.toks, r.lps, reason, t)
        r.toks = r.lps = None
        r.lane.left -= 1
        if r.lane.left == 0:
            self._finish_lane(r.lane)

    def _finish_lane(self, lane: _Lane) -> None:
        jl = lane.lane
        for i, (toks, lps, reason, end) in sorted(lane.results.items()):
            s = jl.samples[i]
            text_ids = toks[:-1] if reason == "stop" and toks and toks[-1] in self.stop_ids else toks
            s.append_model_turn(toks, lps, jl.version, reason,
                                text=self.e.tokenizer.decode(text_ids, skip_special_tokens=True))
            s.requests[-1].cached_tokens = lane.cached[i]
            s.requests[-1].finished_ms = end
        self.feed.finish(jl)

    # ------------------------------------------------------------------ the batch's rows
    def compact(self, tok: torch.Tensor, admitting: bool) -> torch.Tensor | None:
        """Drop ended rows (every time when a job waits to join, else as a job alone does: once a
        quarter of the batch ended); returns the kept rows' tokens, None when no row is left."""
        import torch

        live = [i for i, r in enumerate(self.rows) if r.toks is not None]
        if not live:
            self.rows, self.state = [], None
            return None
        if len(live) < len(self.rows) and (admitting or len(live) <= 0.75 * len(self.rows)):
            keep = torch.tensor(live, dtype=torch.long, device=self.e.device)
            self.state = self.e.decoder.select(self.state, keep)
            self.seed, self.step, tok = self.seed[keep], self.step[keep], tok[keep]
            self.pos, self.lim = self.pos[keep], self.lim[keep]
            self.rows = [self.rows[i] for i in live]
        return tok

    def decode(self, tok: torch.Tensor) -> None:
        """Feed each row's token at its own position (cache column :attr:`col`, shared by every row)."""
        self.logits = self.e.decoder.step(self.state, tok[:, None], (self.pos + self.step - 1)[:, None], self.col)
        self.col += 1


def run_merged(engine: TorchEngine, first: JobLane, feed: JobFeed) -> None:
    """The merged decode loop: draw, drop and finish, admit, feed; until no row is left and no job joins."""
    import torch

    batch = MergedBatch(engine, feed, first)
    with torch.inference_mode(), engine.runtime.exact("rollout"):
        batch.admit([first])
        while True:
            if batch.state is None:  # every row ended: start over with what is queued, if anything
                lanes = feed.admit(batch.size, batch.sampling)
                if not lanes:
                    return
                # a fresh batch: its stop set is read now (a job queued the moment the last one returned
                # raced into the old batch's, with the engine's eos ids of before: test_step_speed in CI)
                batch = MergedBatch(engine, feed, lanes[0])
                batch.admit(lanes)
                continue
            tok = batch.draw_step()
            live = sum(r.toks is not None for r in batch.rows)
            waiting = live > 0 and feed.waiting(batch.size - live, batch.sampling)
            tok = batch.compact(tok, waiting)
            if tok is None:
                continue
            # rows that ended are fed too until compacted (harmless: nothing reads their outputs)
            batch.decode(tok)
            if waiting:
                lanes = feed.admit(batch.size - len(batch.rows), batch.sampling)
                if lanes:
                    batch.admit(lanes)
