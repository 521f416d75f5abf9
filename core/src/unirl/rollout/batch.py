"""``rollout.controller: batch``, the default: one ``engine.generate`` per collect.

Why a controller at all for the plain case: the trainer then has one way to get a batch (train and
eval, sync and async, SFT warm start), so a recipe with a tool-using controller and a plain one run
through the same loop, and there is no "no controller" branch to drift. What stays the trainer's (the
driver's) is policy: DAPO's refill rounds, the staleness window, when weights move.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unirl.config import RunConfig
from unirl.contracts import RolloutController, RolloutEngine, SamplingParams
from unirl.data.chat import response_end_id
from unirl.kernel.errors import UniRLError, WorkerLostError
from unirl.kernel.manager import Kernel
from unirl.rewards.builtin import score
from unirl.samples import Sample, expand


def sft_samples(prompts: list[Sample], tokenizer: Any, end_id: int | None = None) -> list[Sample]:
    """The batch controller's warm-start traces: the gold answer as the whole response, then ``end_id``
    (eos; the chat template's end-of-turn token under ``data.chat_template``)."""
    end = tokenizer.eos_token_id if end_id is None else end_id
    out = []
    for p in prompts:
        s = p.child(0)
        s.status = "ok"
        s.response_ids = tokenizer.encode(f" {p.answer}", add_special_tokens=False) + [end]
        s.loss_mask = [1] * len(s.response_ids)
        out.append(s)
    return out


class EngineFailedError(WorkerLostError):
    """The rollout engine failed a launch with an error of its own kind (a killed worker's
    ``ConnectionError``, a CUDA fault): the message names the engine and the launch, and the launch is
    dropped whole (no sample of it is scored or trained on). A restartable loss (``run.max_restarts``)."""


class BatchController(RolloutController):
    """Draw ``groups`` prompts, launch each ``n`` times under the trainer's launch tag, generate, validate
    what the engine returned, score. Nothing is carried between collects (``state_dict`` is empty), so
    collects may run concurrently (stream mode): each is one ``generate`` on the thread-safe engine."""

    concurrent_collects = True

    def __init__(self, *, config: RunConfig, engine: RolloutEngine, tokenizer: Any, reward_fn: Any,
                 kernel: Kernel | None = None, tag: str = "train", base_seed: int | None = None) -> None:
        self.engine, self.tokenizer, self.reward_fn = engine, tokenizer, reward_fn
        self.engine_name, self.base_seed = config.rollout.engine, base_seed
        # the eval controller: every eval samples a prompt under the same seeds (fresh ids per launch)
        self.seed_tag = tag if tag == "eval" else None
        self.chat_template = config.data.chat_template

    def collect(self, draw: Callable[[int], list[Sample]], *, groups: int, n: int, sampling: SamplingParams,
                launch_tag: str) -> list[Sample]:
        slots = expand(draw(groups), n, tag=launch_tag, base_seed=self.base_seed, seed_tag=self.seed_tag)
        version = self.engine.weight_version
        try:
            self.engine.generate(slots, sampling)
        except UniRLError:
            raise  # already names what failed (e.g. vLLM's EngineReplicaLost)
        except Exception as exc:  # noqa: BLE001 - any other engine failure: name the engine and the launch
            raise EngineFailedError(
                f"rollout engine '{self.engine_name}' failed launch {launch_tag} ({len(slots)} samples, weight "
                f"version {version}): {type(exc).__name__}: {exc}. No sample of it was trained on; restart from "
                "the latest checkpoint (run.resume=true), or let run.max_restarts do it.") from exc
        for s in slots:
            s.validate(source=f"rollout engine '{self.engine_name}'")
        score(slots, self.reward_fn)
        return slots

    def metrics(self) -> dict[str, float]:
        return {}

    def warm_start_samples(self, prompts: list[Sample]) -> list[Sample]:
        # the end token is read here, not at construction: a controller that only generates (an engine
        # that detokenizes itself, tokenizer None) never needs it
        return sft_samples(prompts, self.tokenizer, response_end_id(self.tokenizer, self.chat_template))

    def close(self) -> None:
        """Nothing of its own is in flight: ``generate`` returned before ``collect`` did."""
