"""From ``reward.name`` to the object a run scores with, its preflight, and its metrics.

A ``rewards`` registry entry is one of two things, told apart by the contract class, never by probing
attributes: a :class:`~unirl.contracts.BatchReward` subclass (built once per run with the config and
the kernel: judges and reward models hold a model), or a per-sample function ``fn(completion, sample)``
(used as is). Anything else is a plugin bug, reported in preflight.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from unirl.contracts import BatchReward
from unirl.kernel.errors import PluginError, Violation

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import RunConfig
    from unirl.kernel.manager import Kernel
    from unirl.rewards.builtin import Reward
    from unirl.samples import Sample

CORE = "unirl-core"


def reward_factory(kernel: Kernel, name: str) -> Any:
    """The registered factory for ``name``: a BatchReward subclass or a per-sample function."""
    factory = kernel.get("rewards", name).load()
    if isinstance(factory, type) and not issubclass(factory, BatchReward):
        raise PluginError(f"reward '{name}' is a class ({factory.__qualname__}) that is not a "
                          "unirl.contracts.BatchReward subclass; register a BatchReward or a function "
                          "fn(completion, sample) -> float")
    if not callable(factory):
        raise PluginError(f"reward '{name}' is {type(factory).__name__}, not callable")
    return factory


def build_reward(config: RunConfig, kernel: Kernel, name: str | None = None) -> Reward:
    """The reward ``name`` (default ``reward.name``) ready to score: a built BatchReward, or the function."""
    factory = reward_factory(kernel, name or config.reward.name)
    if isinstance(factory, type):
        return factory(config=config, kernel=kernel)
    return factory


def close_reward(reward: Any) -> None:
    if isinstance(reward, BatchReward):
        reward.close()


def reward_values(reward: Reward, completions: list[str], samples: list[Sample]) -> list[float]:
    """Rewards of a batch from either kind, NaN for a sample that failed (its reason in
    ``meta["reward_error"]``); a per-sample function that raises fails only its sample."""
    if isinstance(reward, BatchReward):
        return [float(v) for v in reward.score_batch(completions, samples)]
    out = []
    for text, s in zip(completions, samples, strict=True):
        try:
            value = float(reward(text, s))
        except Exception as exc:  # noqa: BLE001 - one sample fails, the batch goes on
            s.meta["reward_error"] = f"reward raised {type(exc).__name__}: {exc}"
            value = math.nan
        out.append(value)
    return out


def reward_term_metrics(samples: list[Sample]) -> dict[str, float]:
    """``reward/<name>``: the mean of each named reward part over the samples that have it (not NaN)."""
    sums: dict[str, list[float]] = {}
    for s in samples:
        for name, value in s.meta.get("reward_terms", {}).items():
            if not math.isnan(value):
                sums.setdefault(name, []).append(value)
    return {f"reward/{name}": sum(v) / len(v) for name, v in sums.items()}


def gold_parsers(config: RunConfig, kernel: Kernel) -> dict[str, Callable[[Any], Any]]:
    """``{reward name: parse_gold}`` of the selected reward, or of each term of a composition that reads
    ``reward.terms``: what preflight runs over every gold answer of the dataset files.

    ``parse_gold`` is what a reward declares with :func:`unirl.rewards.builtin.gold_parser` (an attribute
    of the function, or of a BatchReward class). A reward without one (a judge, a reward model) cannot
    tell a readable gold answer from its input alone and is left out; so is one that does not resolve
    (the selection check reports it)."""
    out: dict[str, Callable[[Any], Any]] = {}
    names = [config.reward.name]
    while names:
        name = names.pop(0)
        try:
            factory = reward_factory(kernel, name)
        except PluginError:
            continue
        parse = getattr(factory, "parse_gold", None)
        if callable(parse):
            out[name] = parse
        if isinstance(factory, type) and "terms" in factory.reads and name == config.reward.name:
            names += [t for t in config.reward.terms if t != name]
    return out


def reward_violations(config: RunConfig, kernel: Kernel) -> list[Violation]:
    """The selected reward's own checks (:meth:`BatchReward.check`), and ``reward.*`` sub-sections that
    are set while nothing selected reads them (``reward.judge`` given but ``reward.name: exact_int``)."""
    r = config.reward
    try:
        factory = reward_factory(kernel, r.name)
    except PluginError as exc:
        if "is a class" in str(exc) or "not callable" in str(exc):
            return [Violation(CORE, "reward.name", str(exc), "a plugin bug: report it to the reward's plugin")]
        return []  # not registered: the selection check reports it
    out: list[Violation] = []
    reads: set[str] = set()
    if isinstance(factory, type):
        try:
            out += factory.check(config, kernel)
        except Exception as exc:  # noqa: BLE001 - a broken check is itself a violation
            out.append(Violation(CORE, "reward.name", f"check() of reward '{r.name}' raised "
                                 f"{type(exc).__name__}: {exc}", "report it to the reward's plugin"))
        reads = set(factory.reads)
        if "terms" in reads:  # a composition reads what its terms read
            for term in r.terms:
                try:
                    f = reward_factory(kernel, term)
                except PluginError:
                    continue
                reads |= set(f.reads) if isinstance(f, type) else set()
    for sub in ("terms", "judge", "reward_model"):
        if sub in r.model_fields_set and sub not in reads:
            out.append(Violation(CORE, f"reward.{sub}", f"set, but reward '{r.name}' does not read it",
                                 f"select a reward that uses it (reward.name: {'weighted' if sub == 'terms' else sub}"
                                 f"{', or list it in reward.terms' if sub != 'terms' else ''}), or remove reward.{sub}"))
    return out
