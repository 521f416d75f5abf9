"""State owned, not rewired (issue 72, item 4): the components are built once and frozen, the run's own
state lives on the run, and the checkpointer asks the stateful parts it was handed for their state.

The oracle for the checkpoint is what the actor stored, read back by the actor (not through the
checkpointer): its trainer state keeps the format every older checkpoint has (``step``, ``cursor``,
``version``, ``history``, ``controller``), so a checkpoint written before this change still loads.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from unirl.actor.torch_actor import TorchActor
from unirl.config import RunConfig
from unirl.contracts import VersionLedger
from unirl.data.datasets import PromptCursor
from unirl.models.qwen3 import Qwen3Adapter
from unirl.samples import Sample
from unirl.testing import default_runtime
from unirl.trainer.checkpointer import Checkpointer, ServedVersion
from unirl.trainer.components import Components
from unirl.trainer.loop import Run, TrainResult

RUN_STATE = {"last_batch", "failure_example", "mismatch", "tracer_closed"}


def components() -> Components:
    return Components(adapter=None, tokenizer=None, runtime=None, actor=None, engine=None, sync=None,
                      estimator=None, reward_fn=None, modifiers=[])


def test_components_are_frozen_and_hold_no_run_state():
    """Every field refuses reassignment after build (a driver cannot rewire the controller through it),
    and what changes during a run is a field of :class:`Run`, not of the components."""
    c = components()
    names = [f.name for f in dataclasses.fields(Components)]
    assert "controller" in names and not RUN_STATE & set(names)
    for name in names:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(c, name, object())
    assert RUN_STATE <= {f.name for f in dataclasses.fields(Run)}


class Counter:
    """A stateful part with a dict state: stands for the driver, which is added after the resume."""

    def __init__(self) -> None:
        self.state: dict = {}

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def parts(prompts: list[Sample]) -> tuple[PromptCursor, VersionLedger, TrainResult]:
    return PromptCursor(prompts, 2, seed=3), VersionLedger(), TrainResult(run_dir=None)


def test_checkpointer_saves_and_restores_the_parts_it_was_handed(tmp_path):
    from transformers import Qwen3ForCausalLM

    config = RunConfig.model_validate({"trainer": {"steps": 4, "save_every": 2}})
    hf = Qwen3Adapter().hf_config(config, vocab_size=64, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    actor = TorchActor(config=config, runtime=default_runtime(config), adapter=Qwen3Adapter(),
                       model=Qwen3ForCausalLM(hf).float())
    prompts = [Sample(id=f"p{i}", prompt_ids=[2 + i]) for i in range(6)]
    cursor, ledger, result = parts(prompts)
    cursor.next_batch()
    ledger.version, result.history = 5, [{"step": 0, "eval": 0.25}, {"step": 1, "loss": 0.5}]
    driver = Counter()
    driver.state = {"carried": [1, 2]}
    saver = Checkpointer(actor, config, tmp_path, {"cursor": cursor, "version": ServedVersion(ledger),
                                                   "history": result})
    saver.add("controller", driver)
    assert saver.should_save(2) and not saver.should_save(3) and saver.should_save(4)
    ckpt = saver.save(2)

    extra = actor.load(str(ckpt))  # the trainer state as the actor stored it, not through the checkpointer
    assert {"step", "cursor", "version", "history", "controller"} <= set(extra)
    assert extra["step"] == 2 and extra["version"] == 5 and extra["controller"] == {"carried": [1, 2]}
    assert extra["cursor"] == cursor.state_dict() and extra["history"] == result.history

    cursor2, ledger2, result2 = parts(prompts)
    loader = Checkpointer(actor, config, tmp_path, {"cursor": cursor2, "version": ServedVersion(ledger2),
                                                    "history": result2})
    assert loader.load(None) is None
    assert loader.load(ckpt) == 2
    assert cursor2.state_dict() == cursor.state_dict() and result2.history == result.history
    assert ledger2.version == 4  # one below: the first publish serves the checkpoint's weights as version 5
    late = Counter()
    loader.add("controller", late)  # built after the first publish, restored when it joins
    assert late.state == {"carried": [1, 2]}
