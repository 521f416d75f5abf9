"""``held_ceiling`` (stream mode's launch bound) against a direct simulation of the buffer.

The oracle replays the stream policy step by step, with instant generation (the worst case for waste:
every launch the ceiling allows is in the buffer before the next take): launch up to the ceiling, take
``per_take`` groups oldest first, sync every ``interval`` takes, evict what is older than ``max_staleness``.
The ceiling must waste nothing, never starve a take, and be tight (one group more is evicted)."""

from __future__ import annotations

import time

import pytest

from unirl.rollout.stream import held_ceiling


def simulate(per_take: int, max_staleness: int, interval: int, takes: int, extra: int = 0) -> tuple[int, int]:
    """(groups evicted, takes that found fewer than ``per_take`` groups); ``extra`` groups over the ceiling."""
    version, done, buffer, evicted, starved = 0, 0, [], 0, 0

    def fill() -> None:
        cap = held_ceiling(per_take=per_take, max_staleness=max_staleness, interval=interval,
                           takes_this_version=done) + extra
        buffer.extend([version] * max(0, cap - len(buffer)))

    for _ in range(takes):
        fill()
        evicted += sum(1 for m in buffer if version - m > max_staleness)
        buffer = sorted(m for m in buffer if version - m <= max_staleness)
        starved += len(buffer) < per_take
        buffer, done = buffer[per_take:], done + 1
        fill()  # launches while the trainer trains
        if done == interval:  # the sync
            version, done = version + 1, 0
    return evicted, starved


@pytest.mark.parametrize("per_take", [1, 4, 16])
@pytest.mark.parametrize("max_staleness", [0, 1, 2])
@pytest.mark.parametrize("interval", [1, 2, 3])
def test_nothing_is_generated_to_be_evicted_and_no_take_starves(per_take, max_staleness, interval):
    assert simulate(per_take, max_staleness, interval, takes=40) == (0, 0)


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
@pytest.mark.parametrize("interval", [1, 2])
def test_the_ceiling_is_tight(max_staleness, interval):
    evicted, _ = simulate(4, max_staleness, interval, takes=40, extra=1)
    assert evicted > 0  # one group over the ceiling expires


def test_values():
    # staleness 1, a sync per take: two takes' worth before the take, one while the trainer trains
    assert held_ceiling(per_take=16, max_staleness=1, interval=1, takes_this_version=0) == 32
    assert held_ceiling(per_take=16, max_staleness=1, interval=1, takes_this_version=1) == 16
    # on-policy: nothing launches between a version's last take and its sync
    assert held_ceiling(per_take=16, max_staleness=0, interval=1, takes_this_version=1) == 0


def test_a_stream_pool_at_the_ceiling_evicts_nothing_and_holds_one_step_while_training():
    """The real pool (oldest-first takes, the take counter, held groups counted with running launches) with
    instant generation on the torch engine's thread pool: 12 steps at max_staleness 1, a version per step.
    Without the ceiling (``take_size`` unset, the cap alone: two steps' worth) the same run evicts."""
    from unirl.config import RunConfig
    from unirl.contracts import RolloutController, VersionLedger
    from unirl.models.qwen3 import Qwen3Adapter
    from unirl.models.tokenizer import build_demo_tokenizer
    from unirl.rollout.stream import StreamingController
    from unirl.samples import Sample
    from unirl.testing import build_engine

    class Instant(RolloutController):
        concurrent_collects = True

        def collect(self, draw, *, groups, n, sampling, launch_tag):
            out = []
            for i in range(2):
                s = Sample(id=f"p@{launch_tag}/{i}", prompt_ids=[1, 2])
                s.append_model_turn([3], [-0.1], ledger.version, "stop")  # generated under the served version
                out.append(s)
            return out

        def metrics(self):
            return {}

        def warm_start_samples(self, prompts):
            return []

        def close(self):
            pass

    engine = build_engine(RunConfig(), adapter=Qwen3Adapter(), tokenizer=build_demo_tokenizer())
    evicted = {}
    try:
        for take_size in (4, None):
            ledger, ctl = VersionLedger(), Instant()
            p = StreamingController(ctl, engine, ledger, collect_group=lambda tag, c=ctl: c.collect(
                None, groups=1, n=2, sampling=None, launch_tag=tag), slots=16, max_staleness=1,
                stall_timeout_s=30.0, engine_name="torch", buffer_cap=8, take_size=take_size)
            for _ in range(12):
                assert len(p.take(4)) == 4
                if take_size:
                    with p._cv:  # while the trainer trains: one step's worth, launched or buffered
                        assert len(p._buffer) + len(p._running) <= 4
                time.sleep(0.02)
                with p._cv:
                    ledger.version += 1  # the sync
            p.close()
            evicted[take_size] = p.evicted_total
    finally:
        engine.close()
    assert evicted[4] == 0 and evicted[None] > 0, evicted
