"""An in-process test plugin: a reward with signal on an untrained model.

The demo's ``exact_int`` scores 0 for every completion of a random tiny model, so GRPO's advantages, the
gradients and the adapter's update are all exactly 0 and a short run cannot show that anything trains.
``digits`` (the share of characters that are digits) differs between siblings from the first step.
Register with ``load_kernel(extra=[("digit_reward", digit_reward)])`` and ``reward.name=digits``.
"""

from __future__ import annotations

from typing import Any

from unirl.api import hookimpl


def digit_share(completion: str, sample: Any) -> float:
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


@hookimpl
def unirl_rewards():
    return {"digits": "digit_reward:digit_share"}
