"""``held_ceiling`` (stream mode's launch bound) against a direct simulation of the buffer.

The oracle replays the stream policy step by step, with instant generation (the worst case for waste:
every launch the ceiling allows is in the buffer before the next take): launch up to the ceiling, take
``per_take`` groups oldest first, sync every ``interval`` takes, evict what is older than ``max_staleness``.
The ceiling must waste nothing, never starve a take, and be tight (one group more is evicted)."""

from __future__ import annotations

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
