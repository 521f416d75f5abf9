"""The rollout controller contract and what it drives: environments and their tools."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from unirl.contracts.capabilities import ControllerCapabilities
from unirl.samples import Sample

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import RunConfig
    from unirl.contracts.sampling import SamplingParams


@dataclass
class ToolResult:
    """What a tool call returns to the model, as text; ``error`` marks a failed call (still observed)."""

    content: str
    error: bool = False


class Tool(ABC):
    """A tool an agent may call (``rollout.tools``). Built as ``factory(config=RunConfig)``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""

    @abstractmethod
    def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Run the tool on validated JSON ``arguments``; never raise for bad input, return an error."""


@dataclass
class EnvStep:
    """An environment's answer to one model turn: text to append as an observation (may be empty),
    whether the trajectory is over, and the reward when it is."""

    observation: str = ""
    done: bool = False
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """A multi-turn environment (``rollout.environment``), re-entrant across concurrent trajectories.

    Built as ``factory(config=RunConfig, tools=dict[str, Tool], tokenizer=...)``; state per trajectory
    is keyed by ``sample.id``. ``close(sample)`` always runs: on success, crash and abort."""

    #: whether a trajectory holds state outside its tokens (e.g. a tool session): such a trajectory
    #: cannot be resumed after a weight sync by replaying its tokens, so a controller drops it instead
    stateful: bool = False
    #: stop strings a model turn needs (e.g. ``"</tool_call>"``, so a turn ends right after a call); the
    #: rollout controller adds them to the sampling params
    stop: tuple[str, ...] = ()

    @abstractmethod
    def reset(self, sample: Sample) -> None:
        """Start a trajectory for ``sample``. A sample that already has turns is being resumed (a carried
        tail restored from a checkpoint): a stateless environment derives its state from the sample."""

    @abstractmethod
    def step(self, sample: Sample, turn_text: str) -> EnvStep:
        """React to the model's latest turn."""

    @abstractmethod
    def close(self, sample: Sample) -> None:
        """Release what ``reset`` took for ``sample``."""


class RolloutController(ABC):
    """How a step's groups are generated (``rollout.controller``): ``batch``, core's default, is one
    ``engine.generate`` per collect; a plugin's drives multi-turn environments or partial rollout. The
    trainer keeps the policy: it calls :meth:`collect` once per step (DAPO: once per refill round) and
    per eval, syncs weights after it returns (async: on a background thread, one collect ahead), and
    calls :meth:`close` at the end of the run. Built as documented on ``unirl_rollout_controllers``."""

    #: it implements ``rollout.branching`` (forks trajectories at given turns; then a collect returns
    #: more than ``groups * n`` samples: each fork's branches replace the trajectory that forked);
    #: preflight refuses ``rollout.branching`` for a controller that does not
    supports_branching: ClassVar[bool] = False
    #: :meth:`collect` may run on several threads at once (``rollout.mode: stream`` launches one group per
    #: call, concurrently); preflight refuses stream mode for a controller that does not declare it
    concurrent_collects: ClassVar[bool] = False

    @classmethod
    def capabilities(cls, config: RunConfig) -> ControllerCapabilities:
        """What it drives (environments, multi-turn trajectories): preflight pairs it with
        ``rollout.environment`` from this. This default: single-turn, no environment (core's ``batch``)."""
        return ControllerCapabilities()

    @abstractmethod
    def collect(self, draw: Callable[[int], list[Sample]], *, groups: int, n: int,
                sampling: SamplingParams, launch_tag: str) -> list[Sample]:
        """``groups`` whole groups of ``n`` scored, validated samples (fewer only when ``draw(k)``, which
        returns up to ``k`` fresh prompts, runs dry). When it returns nothing is in flight on the engine,
        so the trainer may sync weights; failed samples (reward NaN) stay in their group.

        ``launch_tag`` is unique within the run: ``train-{step}`` (a DAPO refill round:
        ``train-{step}.{k}``) or ``eval-{step}``. A controller that launches each drawn prompt once may
        use it as the :func:`unirl.samples.expand` tag, so sample ids and seeds follow the step (a resumed
        run samples what the uninterrupted one did); one that keeps its own counter may ignore it."""

    @abstractmethod
    def metrics(self) -> dict[str, float]:
        """Metrics of the last :meth:`collect`, logged with the step (names prefixed by the plugin)."""

    @abstractmethod
    def warm_start_samples(self, prompts: list[Sample]) -> list[Sample]:
        """SFT warm-start traces for ``prompts`` in this controller's trajectory format (e.g. a tool call,
        the tool's turn with loss mask 0, the answer): the trainer's ``sft.steps`` train on these."""

    @abstractmethod
    def close(self) -> None:
        """Abort what is in flight and release every trajectory; idempotent."""

    def state_dict(self) -> dict[str, Any]:
        """What the controller carries from one :meth:`collect` to the next (e.g. a partial rollout's
        tail), saved with every checkpoint (pickled, after :meth:`collect` returned); ``{}`` when it
        carries nothing. Raise, naming the fix, when the carried state cannot be saved soundly."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into a fresh controller on resume, before its first :meth:`collect`."""
        if state:
            raise NotImplementedError(f"{type(self).__name__} saved carried state but cannot restore it")
