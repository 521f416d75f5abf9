"""``AgenticRolloutController``: multi-turn trajectories on any :class:`~unirl.contracts.RolloutEngine`.

The trainer makes one call per step::

    groups = controller.collect(draw, groups=prompts_per_step, n=rollout.n, sampling=sampling)

``draw(k)`` returns up to ``k`` fresh dataset prompts (e.g. ``PromptCursor.next_batch``); the result is
``groups * n`` scored, terminal samples (more with branching: see below), whole GRPO groups in commit
order, each validated. When it
returns, none of the controller's requests is in flight, so the trainer may sync weights at once.

How a drive runs (the engine is used only through its contract: submit / poll / abort):

* **pool**: at most ``workers * trajectories_per_worker`` live trajectories, each pinned to one worker
  (a thread that runs its environment steps and tools); separately at most ``max_inflight_requests``
  model turns are submitted to the engine at once. A slow tool therefore holds a trajectory slot, not
  an engine slot.
* **turns**: a ready trajectory is submitted for one model turn (``new_token_limit`` bounds it; a spent
  budget or an observation that would overflow ``max_response_tokens`` is a context overflow). The engine
  appends the turn in place (ids as generated, raw log-probs, served version per token); the
  environment sees that turn's text and answers; its observation is tokenized on its own and appended
  with loss mask 0. Token ids of the model are never re-encoded.
* **groups**: a terminal trajectory goes to :class:`~unirl_agentic.groups.PendingGroups`; a group is
  committed only when all n siblings are terminal. Terminal samples are stamped at completion time:
  ``meta["version"]`` (the engine's version then) and ``meta["min_version"]`` (oldest token's).
* **partial rollout**: ``ceil(groups * over_generate)`` groups are kept launched; the first ``groups`` to
  complete are committed. The rest, the *tail*, is stopped at a turn boundary: no new turn starts, and
  in-flight turns either finish (``interrupt: drain``, the default: their tokens are kept, stamped with the
  old version) or are aborted and rewound to the last boundary (``interrupt: abort``: the partial turn is
  discarded and regenerated later, so the sync waits less); running environment steps finish. Then
  ``carry`` keeps the tail for the next drive (it resumes under the new weights; the per-token versions
  say which policy made which token) or ``drop`` closes it and discards its groups (a dropped tail is
  always aborted). ``auto`` drops for a stateful environment (:attr:`Environment.stateful`), carries
  otherwise.
* **ids**: every refill of every drive launches under its own tag (``{tag}{drive}.{refill}``), so a
  prompt drawn twice never merges into one group.
* **failures**: an engine error, an environment or tool fault (timeout, crash) or a context overflow
  marks the trajectory failed (reward NaN): the estimator excludes it from its group, it is never a miss.
* ``Environment.close(sample)`` runs exactly once per trajectory on every exit path (terminal, dropped,
  crashed, forked, :meth:`close`).
* **branching** (``rollout.branching: {at_turns, n}``, training only): a trajectory that is ready for its
  model turn k, k in ``at_turns``, is replaced by ``n`` branches (:meth:`Sample.fork`: ids
  ``.../f{k}.{b}``, the parent's Parts as their shared prefix, a seed each). The parent's environment is
  closed; each branch resets its own (the environment must be stateless: a tool session cannot be
  copied) and waits at the front of the backlog, so the branches are admitted and submitted together and
  the embedded engine prefills their shared context once (vLLM: its prefix cache hits on the same ids).
  A branch never forks again at its own fork turn; at a later turn in ``at_turns`` it forks again
  (``.../f1.0/f3.1``). Its root group then waits for n - 1 more members, so a collect returns more than
  ``groups * n`` samples; ``algorithm.group_layer: fork`` compares the branches of each fork point.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from unirl.api import (
    BranchingSection,
    ControllerCapabilities,
    Environment,
    EnvStep,
    Kernel,
    RolloutController,
    RolloutEngine,
    RunConfig,
    Sample,
    SamplingParams,
    chat_turn_ids,
    end_of_turn_id,
    expand,
    fork_point,
)
from unirl_agentic.environment import FORMATS
from unirl_agentic.groups import PendingGroups
from unirl_agentic.options import AgenticOptions, agentic_options
from unirl_agentic.traces import answer_trace, tool_trace
from unirl_agentic.trajectories import Submissions, Trajectory, TrajectoryPool

RewardFn = Callable[[str, Sample], float]


@dataclass
class DriveStats:
    """What one :meth:`AgenticRolloutController.collect` did (logged with the step)."""

    drive: int = 0
    launched_groups: int = 0
    committed_groups: int = 0
    carried: int = 0
    dropped: int = 0
    failed: int = 0
    tool_failures: int = 0  # trajectories ended by a tool fault (timeout, dead session, a tool that raised)
    rewound_turns: int = 0
    forks: int = 0  # fork points taken (rollout.branching): each replaced one trajectory by n branches
    mean_turns: float = 0.0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        return {f"agentic/{k}": float(v) for k, v in vars(self).items() if k not in ("extra", "drive")}


class AgenticRolloutController(RolloutController):
    supports_branching = True
    # rollout.mode: stream runs one-group collects from several threads: they take turns on one lock (a
    # drive owns the pool, the submissions and the carried tail), and the overlap comes from inside a drive
    # (over_generate keeps more groups launched; a carried tail resumes under the new weights)
    concurrent_collects = True

    @classmethod
    def capabilities(cls, config: RunConfig) -> ControllerCapabilities:
        """It runs ``rollout.environment``'s turns: reset, one model turn, step, until done."""
        return ControllerCapabilities(drives_environments=True, multi_turn=True)

    def __init__(self, engine: RolloutEngine, env: Environment, tokenizer: Any, reward_fn: RewardFn,
                 options: AgenticOptions | None = None, *, tag: str = "agentic", base_seed: int | None = None,
                 repeat_seeds: bool = False, chat_template: bool = False,
                 branching: BranchingSection | None = None):
        if "/" in tag or "@" in tag or not tag:
            raise ValueError(f"controller tag {tag!r} must be non-empty, without '/' or '@'")
        if branching is not None and env.stateful:
            raise ValueError(f"rollout.branching: the environment {type(env).__name__} is stateful (a trajectory "
                             "holds a tool session, which a fork cannot copy); fix: remove rollout.branching or "
                             "use stateless tools")
        self.branching = branching
        self.engine, self.env, self.tokenizer, self.reward_fn = engine, env, tokenizer, reward_fn
        self.options = options or AgenticOptions()
        # data.chat_template: every observation is a turn of the tokenizer's chat template, appended after
        # the template's end-of-turn token, so a trajectory is token for token the conversation it renders
        self.chat = chat_template
        self.eot = end_of_turn_id(tokenizer) if chat_template else None
        # repeat_seeds (held-out eval): every drive samples a prompt with the same seeds, so evals at
        # different steps compare like with like; otherwise each launch gets its own (ids stay unique)
        self.tag, self.base_seed, self.repeat_seeds = tag, base_seed, repeat_seeds
        self.tail: Literal["carry", "drop"] = self._tail_policy()
        o = self.options
        self._workers = [ThreadPoolExecutor(1, thread_name_prefix=f"agentic-env-{i}") for i in range(o.workers)]
        self._pool = TrajectoryPool(o.workers, o.trajectories_per_worker)  # live trajectories and the backlog
        self._jobs = Submissions()  # the engine jobs in flight
        self._pending = PendingGroups()
        self._complete: list[list[Sample]] = []  # groups completed past a drive's target
        self._drive = 0
        self._closed = False
        self._one_drive = threading.Lock()  # concurrent collects (stream mode) run one drive at a time
        self.last = DriveStats()

    def _tail_policy(self) -> Literal["carry", "drop"]:
        if self.options.tail != "auto":
            return self.options.tail
        return "drop" if self.env.stateful else "carry"

    # ------------------------------------------------------------------ the one call
    def collect(self, draw: Callable[[int], list[Sample]], *, groups: int, n: int,
                sampling: SamplingParams, launch_tag: str = "") -> list[Sample]:
        """``groups`` complete, scored GRPO groups of ``n`` siblings (see the module doc). ``launch_tag``
        is not used: ids come from the controller's own drive counter (a carried tail spans drives).
        Safe to call from several threads (stream mode): the drives run one after another."""
        with self._one_drive:
            return self._collect(draw, groups=groups, n=n, sampling=sampling)

    def _collect(self, draw: Callable[[int], list[Sample]], *, groups: int, n: int,
                 sampling: SamplingParams) -> list[Sample]:
        if self._closed:
            raise RuntimeError("AgenticRolloutController is closed")
        if groups < 1 or n < 1:
            raise ValueError(f"collect: groups={groups} and n={n} must both be >= 1")
        if self.env.stop:  # e.g. a turn ends right after a tool call
            sampling = replace(sampling, stop=tuple(dict.fromkeys((*sampling.stop, *self.env.stop))))
        t0 = time.perf_counter()
        self._drive += 1
        stats = self.last = DriveStats(drive=self._drive)
        want_open = math.ceil(groups * self.options.over_generate)
        committed: list[list[Sample]] = self._complete[:groups]
        self._complete = self._complete[groups:]
        refill, exhausted = 0, False
        try:
            while len(committed) < groups:
                if not exhausted and len(self._pending) + len(committed) < want_open and not self._pool.backlog:
                    k = want_open - len(self._pending) - len(committed)
                    prompts = list(draw(k))[:k]
                    exhausted = not prompts
                    if prompts:
                        self._launch(prompts, n, refill, sampling)
                        stats.launched_groups += len(prompts)
                        refill += 1
                self._admit()
                if self._branch():
                    self._admit()  # the branches wait at the front of the backlog: in together
                self._submit(sampling)
                progressed = self._reap(sampling, committed)
                if not len(self._pool) and len(committed) < groups:
                    if exhausted:
                        break  # the source ran dry: return what completed
                    continue
                if not progressed:
                    self._wait()
            out = committed[:groups]
            self._complete.extend(committed[groups:])
            self._interrupt(stats, sampling)
        except BaseException:
            self._abandon()
            raise
        flat = [s for g in out for s in g]
        for s in flat:
            s.validate(source="agentic controller")
        stats.committed_groups = len(out)
        stats.failed = sum(s.failed for s in flat)
        stats.mean_turns = sum(s.turns for s in flat) / max(len(flat), 1)
        stats.seconds = time.perf_counter() - t0
        return flat

    def metrics(self) -> dict[str, float]:
        """``agentic/*`` metrics of the last :meth:`collect` (logged with the trainer's step)."""
        return self.last.metrics()

    def warm_start_samples(self, prompts: list[Sample]) -> list[Sample]:
        """SFT traces (``plugins.agentic.warm_start``): ``calculator`` calls the calculator on the prompt's
        expression and copies its result (tool turn masked); ``env`` asks the environment for its
        demonstrations (``env.demonstration(prompt, tokenizer, expert=...)``); ``answer`` is the answer alone.

        With ``warm_start_tool_share`` s < 1, trace i of the batch calls the tool iff
        ``floor((i + 1) s) > floor(i s)``: exactly that share of every batch, spread evenly, deterministic."""
        share = self.options.warm_start_tool_share
        expert = [math.floor((i + 1) * share) > math.floor(i * share) for i in range(len(prompts))]
        if self.options.warm_start == "calculator":
            template = FORMATS[self.options.format]
            return [tool_trace(p, self.tokenizer, template, chat=self.chat) if e
                    else answer_trace(p, self.tokenizer, chat=self.chat) for p, e in zip(prompts, expert, strict=True)]
        if self.options.warm_start == "env":
            demo = getattr(self.env, "demonstration", None)
            if demo is None:
                raise ValueError(f"plugins.agentic.warm_start: env, but the environment {type(self.env).__name__} "
                                 "has no demonstration(prompt, tokenizer, expert=...); fix: warm_start: answer")
            return [demo(p, self.tokenizer, expert=e) for p, e in zip(prompts, expert, strict=True)]
        return [answer_trace(p, self.tokenizer, chat=self.chat) for p in prompts]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The carried tail for the trainer's checkpoint (taken after :meth:`collect` returned, when every
        live trajectory waits at a turn boundary): the live trajectories and the backlog (their tokens,
        log-probs and versions), the finished siblings of pending groups, the groups completed past a
        drive's target, and the drive counter (refill tags stay unique after a resume). Their prompts were
        drawn from the data cursor already: without this they would be skipped silently on resume.

        A stateful environment's trajectory holds state outside its tokens (a tool session) and cannot be
        restored from them: refused when such a tail is carried (``tail: drop`` or ``auto`` drops it)."""
        live = self._pool.samples()
        if live and self.env.stateful:
            raise RuntimeError(
                f"agentic controller '{self.tag}': {len(live)} carried trajectories hold tool sessions "
                "(a stateful environment) and cannot be checkpointed; fix: plugins.agentic.tail: auto or drop")
        if any(t.state != "ready" or t.handle is not None for t in self._pool.live()):
            raise RuntimeError(f"agentic controller '{self.tag}': state_dict() during a drive; call it "
                               "between collects")
        return {
            "drive": self._drive,
            "live": [x.copy() for x in live],
            "pending": [(gid, n, [x.copy() for x in done]) for gid, n, done in self._pending.items()],
            "complete": [[x.copy() for x in g] for g in self._complete],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into this fresh controller: the live trajectories go to the front
        of the backlog and resume at their next turn (the environment's ``reset`` sees their turns)."""
        if self._drive or len(self._pool) or len(self._pending) or self._complete:
            raise RuntimeError(f"agentic controller '{self.tag}': load_state_dict() needs a fresh controller")
        if not state:
            return
        self._drive = int(state["drive"])
        for gid, n, done in state["pending"]:
            self._pending.open(gid, n)
            for x in done:
                self._pending.add(x)
        self._pool.backlog.extend(state["live"])
        self._complete = [list(g) for g in state["complete"]]

    def close(self) -> None:
        """Abort everything in flight and close every live trajectory's environment."""
        if self._closed:
            return
        self._abandon()
        for w in self._workers:
            w.shutdown(wait=True)
        self._closed = True

    # ------------------------------------------------------------------ launching
    def _launch(self, prompts: list[Sample], n: int, refill: int, sampling: SamplingParams) -> None:
        tag = f"{self.tag}{self._drive}.{refill}"  # unique per drive and refill: groups never merge
        slots = expand(prompts, n, tag=tag, base_seed=self.base_seed,
                       seed_tag=self.tag if self.repeat_seeds else None)
        for i in range(0, len(slots), n):
            self._pending.open(slots[i].group_id, n)
        self._pool.backlog.extend(slots)

    def _admit(self) -> None:
        while (t := self._pool.admit()) is not None:
            try:
                self.env.reset(t.sample)
            except Exception as exc:  # noqa: BLE001 - an environment fault fails this trajectory only
                self._fail(t, f"environment reset raised {type(exc).__name__}: {exc}")

    def _branch(self) -> bool:
        """``rollout.branching``: replace each ready trajectory at a fork turn by its branches (module doc)."""
        b = self.branching
        if b is None:
            return False
        forked = False
        for t in self._pool.live():
            s = t.sample
            if t.state != "ready" or s.turns not in b.at_turns:
                continue
            fp = fork_point(s.id)
            if fp is not None and fp[1] == s.turns:
                continue  # a branch of this very fork point
            branches = [s.fork(i) for i in range(b.n)]
            self._pending.grow(s.group_id, b.n - 1)
            self._close_env(t)  # the parent is replaced: its slot and environment go, each branch resets its own
            self._pool.backlog.extendleft(reversed(branches))
            self.last.forks += 1
            forked = True
        return forked

    # ------------------------------------------------------------------ turns
    def _submit(self, sampling: SamplingParams) -> None:
        room = self.options.max_inflight_requests - self._jobs.inflight()
        batch: list[Trajectory] = []
        for t in self._pool.live():
            if room <= len(batch):
                break
            if t.state != "ready":
                continue
            if sampling.new_token_limit(t.sample) <= 0:
                self._fail(t, "context overflow: the response budget (rollout.max_response_tokens) is spent")
                continue
            t.snapshot, t.mark, t.state = t.sample.copy(), len(t.sample.response_text), "generating"
            batch.append(t)
        if not batch:
            return
        try:
            h = self.engine.submit([t.sample for t in batch], sampling)
        except Exception as exc:  # noqa: BLE001 - engine refused: these trajectories fail
            for t in batch:
                self._fail(t, f"engine submit raised {type(exc).__name__}: {exc}")
            return
        self._jobs.add(h)
        for t in batch:
            t.handle = h.id

    def _reap(self, sampling: SamplingParams, committed: list[list[Sample]]) -> bool:
        progressed = False
        for hid, h in self._jobs.items():
            try:
                done = self._jobs.take(hid) or self.engine.poll(h, timeout=0.0)
                if isinstance(done, BaseException):
                    raise done
            except Exception as exc:  # noqa: BLE001 - the engine failed this job: its samples fail
                self._jobs.drop(hid)
                for sid in h.sample_ids:
                    t = self._pool.get(sid)
                    if t is not None and t.handle == hid:
                        self._fail(t, f"engine error {type(exc).__name__}: {exc}", committed)
                progressed = True
                continue
            if done:
                progressed = True
                self._jobs.returned(hid, (x.id for x in done))  # leaves once every sample is back
            for s in done:
                t = self._pool.get(s.id)
                if t is None:
                    continue
                t.handle = None
                if s.status == "failed":
                    self._terminal(t, committed)
                    continue
                text = s.response_text[t.mark:]
                t.state = "stepping"
                t.future = self._workers[t.worker].submit(self.env.step, s, text)
        for t in self._pool.live():
            if t.state == "stepping" and t.future is not None and t.future.done():
                self._apply(t, t.future, sampling, committed)
                progressed = True
        return progressed

    def _apply(self, t: Trajectory, fut: Future, sampling: SamplingParams | None,
               committed: list[list[Sample]] | None) -> None:
        t.future = None
        s = t.sample
        try:
            step: EnvStep = fut.result()
        except Exception as exc:  # noqa: BLE001
            self._fail(t, f"environment step raised {type(exc).__name__}: {exc}", committed)
            return
        if step.info.get("failure"):
            self._fail(t, str(step.info["failure"]), committed)
            return
        if step.done:
            s.meta["max_turns"] = bool(step.info.get("max_turns", False))
            if step.reward is not None:
                s.reward = float(step.reward)
            else:
                answer = str(step.info.get("final_answer", ""))
                s.meta["final_answer"] = answer
                try:
                    value = float(self.reward_fn(answer, s))
                except Exception as exc:  # noqa: BLE001 - a reward bug fails one sample
                    self._fail(t, f"reward raised {type(exc).__name__}: {exc}", committed)
                    return
                if not math.isfinite(value):
                    self._fail(t, f"reward returned {value}", committed)
                    return
                s.reward = value
            self._terminal(t, committed)
            return
        try:  # a tool's output is untrusted text: a fault in it ends this trajectory, never the drive
            if self.chat:
                closed = bool(s.response_ids) and s.response_ids[-1] == self.eot
                ids = chat_turn_ids(self.tokenizer, step.observation or "", closed=closed)
            else:
                ids = self.tokenizer.encode(step.observation, add_special_tokens=False) if step.observation else []
        except Exception as exc:  # noqa: BLE001
            self._fail(t, f"tool observation could not be tokenized: {type(exc).__name__}: {exc}", committed)
            return
        cap = sampling.max_response_tokens if sampling is not None else None
        if cap is not None and len(s.response_ids) + len(ids) >= cap:
            self._fail(t, f"context overflow: the observation ({len(ids)} tokens) does not fit the response "
                          f"budget ({cap} tokens)", committed)
            return
        s.append_observation(ids, text=step.observation)
        t.state = "ready"

    # ------------------------------------------------------------------ endings
    def _fail(self, t: Trajectory, reason: str, committed: list[list[Sample]] | None = None) -> None:
        if reason.startswith("tool "):  # a tool fault: recorded in the sample (meta["error"]) and counted
            self.last.tool_failures += 1
        t.sample.mark_failed(reason)
        self._terminal(t, committed)

    def _terminal(self, t: Trajectory, committed: list[list[Sample]] | None) -> None:
        s = t.sample
        self._close_env(t)
        s.meta["version"] = self.engine.weight_version  # completion-time stamp
        s.meta["min_version"] = min((v for v in s.versions if v >= 0), default=-1)
        if s.status == "pending":
            s.mark_failed("trajectory ended before any model turn")
        group = self._pending.add(s) if s.group_id in self._pending else None
        if group is not None and committed is not None:
            committed.append(group)
        elif group is not None:
            self._complete.append(group)

    def _close_env(self, t: Trajectory) -> None:
        if not self._pool.release(t):
            return  # already closed: close runs once per trajectory
        try:
            self.env.close(t.sample)
        except Exception as exc:  # noqa: BLE001 - close must not take the drive down; record it
            t.sample.meta["close_error"] = f"{type(exc).__name__}: {exc}"

    def _wait(self) -> None:
        """Block briefly for the next completion (an engine turn or an environment step)."""
        futs = [t.future for t in self._pool.live() if t.future is not None]
        if self._jobs:  # wait on the oldest job; what it hands back is kept for the next reap
            hid, h = self._jobs.items()[0]
            if not self._jobs.kept(hid):
                try:
                    done = self.engine.poll(h, timeout=0.01 if not futs else 0.002)
                except Exception as exc:  # noqa: BLE001 - re-raised to the reaper as that job's failure
                    self._jobs.keep(hid, exc)
                else:
                    if done:
                        self._jobs.keep(hid, done)
            if futs:
                wait_futures(futs, timeout=0.002, return_when="FIRST_COMPLETED")
        elif futs:
            wait_futures(futs, timeout=0.05, return_when="FIRST_COMPLETED")
        else:
            time.sleep(0.001)

    def _interrupt(self, stats: DriveStats, sampling: SamplingParams) -> None:
        """Stop the tail at a turn boundary; then carry or drop it (see the module doc)."""
        if self.tail == "carry" and self.options.interrupt == "drain":
            late: list[list[Sample]] = []
            while self._jobs:  # in-flight turns finish (no new ones start): nothing is regenerated
                if not self._reap(sampling, late):
                    self._wait()
            self._complete.extend(late)
        for hid, h in self._jobs.items():
            stashed = self._jobs.take(hid)
            aborted = self.engine.abort(h)
            if isinstance(stashed, list):
                aborted = stashed + aborted
            self._jobs.drop(hid)
            for s in aborted:
                t = self._pool.get(s.id)
                if t is None or t.snapshot is None:
                    continue
                t.sample, t.state, t.handle = t.snapshot, "ready", None  # rewind: drop the partial turn
                t.sample.meta["rewound_turns"] = t.sample.meta.get("rewound_turns", 0) + 1
                stats.rewound_turns += 1
        for t in self._pool.live():
            if t.future is not None:  # a running environment step finishes: that is a turn boundary
                wait_futures([t.future])
                self._apply(t, t.future, None, None)
        if self.tail == "carry":
            stats.carried = len(self._pool)
            return
        stats.dropped = len(self._pool)
        doomed = self._pool.group_ids()
        for t in self._pool.live():
            self._close_env(t)
        self._pool.backlog.clear()
        for gid in doomed:
            self._pending.discard(gid)

    def _abandon(self) -> None:
        """A crash or close: abort our requests, let running steps end, close every environment."""
        for _, h in self._jobs.items():
            try:
                self.engine.abort(h)
            except Exception:  # noqa: BLE001, S110 - best effort on the way down
                pass
        self._jobs.clear()
        for t in self._pool.live():
            if t.future is not None:
                wait_futures([t.future])
            self._close_env(t)
        self._pool.backlog.clear()
        self._pending = PendingGroups()


class KernelAgenticController(AgenticRolloutController):
    """``rollout.controller: agentic``: the controller as the trainer builds it, with the environment
    (``rollout.environment``) and its tools (``rollout.tools``) built from the trainer's kernel."""

    def __init__(self, *, config: RunConfig, engine: RolloutEngine, tokenizer: Any, reward_fn: RewardFn,
                 kernel: Kernel, tag: str = "train", base_seed: int | None = None):
        options = agentic_options(config)
        self._ray_started = False
        if options.env_workers:  # the environment lives in Ray actors; the pool stands in for it here
            from unirl.api import connect_ray
            from unirl_agentic.pool import EnvPool, RegistryEnvFactory

            self._ray_started = connect_ray(num_cpus=max(2, options.env_workers))
            env = EnvPool(RegistryEnvFactory(config), options.env_workers)
            options = options.model_copy(update={"workers": max(options.workers, options.env_workers)})
        else:
            tools = {name: kernel.build("tools", name, config=config) for name in config.rollout.tools}
            env = kernel.build("environments", config.rollout.environment, config=config, tools=tools,
                               tokenizer=tokenizer)
        # the trainer's eval controller: the same seeds every eval, and plain trajectories (no branching:
        # held-out accuracy measures the policy, one sample per slot)
        super().__init__(engine, env, tokenizer, reward_fn, options, tag=tag, base_seed=base_seed,
                         repeat_seeds=tag == "eval", chat_template=config.data.chat_template,
                         branching=None if tag == "eval" else config.rollout.branching)

    def close(self) -> None:
        """Also end what this controller built: a pool's workers, or an environment's own resources
        (``shutdown()``: TextWorld's pooled games)."""
        if self._closed:
            return
        super().close()
        shutdown = getattr(self.env, "shutdown", None)
        if shutdown is not None:
            shutdown()
        if self._ray_started:
            import ray

            ray.shutdown()
