"""Helpers shared by the tests, and a scripted *stateless* environment (the one stand-in: it replaces a
task, not a component under test; the engine and the tools are real)."""

from __future__ import annotations

import threading

from unirl.api import Environment, EnvStep, Sample


def prompts(tok, k: int, start: int = 0, text: str = "Q: 12*34=? A:") -> list[Sample]:
    return [Sample(id=f"p{start + i}", prompt_ids=tok.encode(f"{text} {start + i}"), answer=0) for i in range(k)]


def drawer(tok, start: int = 0):
    """A draw(k) that yields fresh prompts p{start}, p{start+1}, ... like a dataset cursor."""
    state = {"next": start}

    def draw(k: int) -> list[Sample]:
        out = prompts(tok, k, state["next"])
        state["next"] += k
        return out

    return draw


def index(sample: Sample) -> int:
    """The slot of the launch (``p0@t/3`` and its fork branches ``p0@t/3/f1.0``: 3)."""
    return int(sample.id.split("/")[1])


class CountdownEnv(Environment):
    """Stateless task: answer after ``turns`` model turns, where ``turns`` is read from the sample id (the
    turn count is the sample's own, so a trajectory restored from a checkpoint resumes exactly)."""

    def __init__(self, turns_of, fail_ids=(), crash_ids=(), probe=None):
        self.probe = probe  # called at every step (tests read engine concurrency there)
        self.peak = 0
        self.turns_of, self.fail_ids, self.crash_ids = turns_of, set(fail_ids), set(crash_ids)
        self.lock = threading.Lock()
        self.opened: dict[str, int] = {}
        self.closes: dict[str, int] = {}
        self.state: dict[str, int] = {}

    def reset(self, sample):
        with self.lock:
            assert sample.id not in self.state, f"{sample.id} reset twice"
            self.state[sample.id] = 0
            self.opened[sample.id] = self.opened.get(sample.id, 0) + 1
            self.peak = max(self.peak, len(self.state))

    def step(self, sample, turn_text):
        with self.lock:
            self.state[sample.id] += 1
            t = sample.turns
        if self.probe is not None:
            self.probe()
        if sample.id in self.crash_ids:
            raise RuntimeError("injected crash")
        if sample.id in self.fail_ids:
            return EnvStep(done=True, info={"failure": "injected tool timeout"})
        if t >= self.turns_of(sample):
            return EnvStep(done=True, reward=float(index(sample) % 2))
        return EnvStep(observation=f"\n<tool_response>obs{t}</tool_response>\n")

    def close(self, sample):
        with self.lock:
            self.state.pop(sample.id, None)
            self.closes[sample.id] = self.closes.get(sample.id, 0) + 1

    def live(self):
        with self.lock:
            return list(self.state)
