"""Seams for plugins beside the engine and actor: parity numerics, trace export, trackers and
batch rewards."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

from unirl.samples import Sample

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    from unirl.config import RunConfig


class ParityProvider(ABC):
    """Reference numerics for one model family that make engine and trainer log-probs bit-identical.

    Registered through ``unirl_parity_providers`` under the name a :class:`ModelAdapter` gives in
    ``parity_adapter``. Core calls it at two places and nowhere else:

    * :meth:`exact_context` around every actor forward that produces objective-facing log-probs
      (replay, the training forward and its backward, so activation-checkpoint recompute is inside);
    * :meth:`install_engine` in the process that builds an engine's model, before it is built.
    """

    #: the number of keys the provider's attention reads per chunk. The embedded engine allocates and
    #: serves its KV cache in whole blocks of it, so the provider's attention reads the cache in place
    #: instead of copying it into zero-padded chunks every decode step (correctness never depends on
    #: it: keys past a query's position are masked zeros). 1: no blocking.
    key_block: ClassVar[int] = 1

    def __init__(self, *, config: RunConfig) -> None:
        self.config = config

    @abstractmethod
    def enabled(self) -> bool:
        """Whether parity is on for this run (e.g. ``UNIRL_PARITY_ENABLE=1``)."""

    @abstractmethod
    def exact_context(self, phase: str) -> AbstractContextManager[Any]:
        """Enter the reference ops for ``phase`` ("replay", "train", "reference")."""

    @abstractmethod
    def install_engine(self, engine: str) -> None:
        """Install the engine-side reference ops for ``engine`` ("torch", "vllm", ...)."""


class TraceExporter(ABC):
    """Receives every scored rollout batch (``trace.exporter``); writes a trace at :meth:`close`.

    Built as ``factory(config=RunConfig, options=Config | None)``: ``options`` is ``trace.options`` as
    the kernel validated it against the ``Config`` model the class declares (None: it declares none)."""

    @abstractmethod
    def record(self, *, phase: str, step: int, version: int, samples: list[Sample]) -> None:
        """Called after every train and eval rollout, with the samples' request records."""

    @abstractmethod
    def close(self) -> str | None:
        """Flush; return the path written (or None)."""


class NullTracer(TraceExporter):
    """``trace.exporter`` unset: records nothing. The trainer always holds a tracer, so no call site asks
    whether there is one."""

    def record(self, *, phase: str, step: int, version: int, samples: list[Sample]) -> None:
        pass

    def close(self) -> str | None:
        return None


class Tracker(ABC):
    """An experiment tracker (``logging.trackers``): gets every row ``metrics.jsonl`` gets, the run's
    parameters once, and artifacts (the curves PNG); core's is ``tensorboard``, ``unirl-trackers`` adds
    W&B, MLflow and Trackio.

    Built once per run as ``factory(config=RunConfig, run_dir=Path, params=dict[str, str],
    resume_step=int | None, options=Config | None)``: ``params`` is the flattened run config plus ``git_revision`` and the
    installed UniRL distributions' versions (``version/<dist>``); ``resume_step`` is the first step a
    resumed run logs again (None for a fresh run). ``options`` is ``logging.options[<name>]`` as the
    kernel validated it against the ``Config`` model the class declares (None: it declares none),
    bound here (``self.options``).

    Why the trainer wraps every call: a tracker is an observer. A network error, a full quota or a
    library bug in one is reported once, counted, and never stops training (:mod:`unirl.trainer.trackers`).
    """

    #: the pydantic model of ``logging.options[<name>]`` (None: takes no options)
    Config: ClassVar[type | None] = None

    def __init__(self, *, config: RunConfig, run_dir: Path, params: dict[str, str],
                 resume_step: int | None = None, options: Any = None) -> None:
        self.config, self.run_dir, self.params, self.resume_step = config, run_dir, params, resume_step
        self.options = options

    @abstractmethod
    def log(self, metrics: dict[str, float], step: int) -> None:
        """One step's finite numeric metrics (``step`` is the row's ``step``)."""

    def log_artifact(self, path: Path) -> None:  # noqa: B027 - optional: a tracker may keep no files
        """A file the run wrote (the curves PNG at the end); default: not kept."""

    @abstractmethod
    def close(self) -> None:
        """Flush and finish the tracker's run."""


class BatchReward(ABC):
    """A reward that scores a whole rollout batch in one call (``reward.name``), registered through
    ``unirl_rewards`` beside the per-sample functions ``fn(completion, sample) -> float``.

    Why a class of its own: a model-based reward (an LLM judge served by an engine, a reward model)
    must batch its model calls across the rollout batch and hold a model for the run, which a
    per-sample function cannot. Built once per run as ``factory(config=RunConfig, kernel=Kernel)``
    (after preflight, so it may load models) and closed at the end of the run.
    """

    #: the ``reward.*`` sub-sections it reads (e.g. ``("judge",)``): preflight flags a sub-section that
    #: is set while the selected reward does not read it (a misconfigured run, not a silent default)
    reads: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def check(cls, config: RunConfig, kernel: Any) -> list[Any]:
        """Preflight: the :class:`~unirl.kernel.errors.Violation` s of ``config`` for this reward (that
        its model loads, its template has its fields ...), cheap, before any model is built."""
        return []

    @abstractmethod
    def score_batch(self, completions: list[str], samples: list[Sample]) -> list[float]:
        """One reward per sample, aligned with ``samples``. NaN marks that sample *failed* (judge error or
        timeout; say why in ``sample.meta["reward_error"]``): it leaves its group's statistics, it is
        never a miss. Named parts of a reward (a composition's terms) go to
        ``sample.meta["reward_terms"]`` (``{name: value}``), which the trainer logs as ``reward/<name>``.
        Raising fails the whole batch."""

    def __call__(self, completion: str, sample: Sample) -> float:
        """The per-sample form (a rollout controller that scores one trajectory at a time)."""
        return self.score_batch([completion], [sample])[0]

    def close(self) -> None:  # noqa: B027 - optional
        """Release the models and engines it holds. Safe to call twice."""
