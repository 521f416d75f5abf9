"""``rollout.mode: async`` with a ``rollout.controller``: :class:`PrefetchingController` runs the next step's
collect on a background thread while the trainer trains, under the async rules (launch ceiling, quiesce
before a sync, staleness stamped on every trajectory), and never prefetches across a checkpoint."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from unirl.config import load_config
from unirl.contracts import RolloutController, SamplingParams, VersionLedger
from unirl.kernel import load_kernel
from unirl.kernel.errors import SyncRefusedError
from unirl.kernel.hookspecs import hookimpl
from unirl.rewards.builtin import score
from unirl.rollout.controller import PrefetchingController
from unirl.samples import Sample, expand
from unirl.testing import default_runtime
from unirl.trainer.loop import sft_samples, train

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "sft.steps=0", "trainer.steps=3", "trainer.prompts_per_step=2", "trainer.eval_every=0",
    "trainer.progress=false", "trainer.plot=false", "trainer.export_hf=false", "data.arith.n_train=64",
    "data.arith.n_eval=2", "trainer.eval_k=1", "rollout.n=2", "rollout.max_new_tokens=4",
    "model.build={hidden_size: 64, intermediate_size: 128}", "rollout.mode=async",
]


class Threaded(RolloutController):
    """One engine call per collect; records the thread each collect ran on and the version it saw."""

    log: list[tuple[str, str, int]] = []
    gate: threading.Event | None = None  # when set, a collect waits on it (holds the drive in flight)

    def __init__(self, *, config=None, engine, tokenizer=None, reward_fn=None, kernel=None, tag="train",
                 base_seed=0):
        self.engine, self.tokenizer, self.reward_fn, self.tag, self.base_seed = engine, tokenizer, reward_fn, tag, base_seed
        self.calls = 0

    def collect(self, draw, *, groups, n, sampling, launch_tag):
        self.calls += 1
        if Threaded.gate is not None:
            Threaded.gate.wait(30)
        Threaded.log.append((self.tag, threading.current_thread().name, self.engine.weight_version))
        slots = expand(draw(groups), n, tag=f"{self.tag}{self.calls}", base_seed=self.base_seed)
        self.engine.generate(slots, sampling)
        if self.reward_fn is not None:
            score(slots, self.reward_fn)
        else:
            for s in slots:
                s.reward = 0.0
        return slots

    def metrics(self):
        return {"threaded/calls": float(self.calls)}

    def warm_start_samples(self, prompts):
        return sft_samples(prompts, self.tokenizer)

    def close(self):
        pass


class Plugin:
    @hookimpl
    def unirl_rollout_controllers(self):
        return {"threaded": Threaded}


def config(tmp_path, *extra):
    return load_config(ROOT / "recipes" / "arith-tiny.yaml", [*SMALL, f"run.output_dir={tmp_path}", *extra])


@pytest.mark.slow
def test_async_trainer_prefetches_the_next_collect_and_stamps_staleness(tmp_path):
    Threaded.log.clear()
    result = train(config(tmp_path, "rollout.controller=threaded", "rollout.max_staleness=1",
                          "trainer.save_every=2"), load_kernel(extra=[("threaded", Plugin())]))
    assert result.steps_done == 3
    train_collects = [e for e in Threaded.log if e[0] == "train"]
    assert len(train_collects) == 3
    steps = [h for h in result.history if h["step"] > 0]
    # step 1's batch is collected at once; step 2's was prefetched in the background while step 1 trained
    # (one version old when trained); step 2 saves a checkpoint, so step 3's is not prefetched
    assert [name.startswith("rollout-controller") for _, name, _ in train_collects] == [True] * 3
    assert [h["staleness_max"] for h in steps] == [0, 1, 0]
    assert [h["version"] for h in steps] == [2, 3, 4]  # one sync per step (the initial publish is 1)
    assert [v for *_, v in train_collects] == [1, 1, 3]  # the version each collect sampled under


def test_prefetch_obeys_the_ceiling_and_a_sync_waits_for_the_collect(tmp_path):
    from unirl.actor.torch_actor import TorchActor
    from unirl.engine.torch_engine import TorchEngine
    from unirl.models.qwen3 import Qwen3Adapter
    from unirl.models.tokenizer import build_demo_tokenizer
    from unirl.sync.inprocess import InProcessSync

    cfg = config(tmp_path)
    tok = build_demo_tokenizer()
    engine = TorchEngine(config=cfg, runtime=default_runtime(cfg), adapter=Qwen3Adapter(), tokenizer=tok)
    actor = TorchActor(config=cfg, runtime=default_runtime(cfg), adapter=Qwen3Adapter(), tokenizer=tok)
    ledger = VersionLedger()
    prompts = [Sample(id=f"p{i}", prompt_ids=tok.encode(f"Q: {i}"), answer=0) for i in range(8)]
    inner = Threaded(engine=engine, tokenizer=tok)
    sp = SamplingParams(max_new_tokens=2)
    queue = list(prompts)

    def collect():
        return inner.collect(lambda k: [queue.pop(0) for _ in range(k)], groups=1, n=2, sampling=sp, launch_tag="t")

    on_policy = PrefetchingController(inner, engine, ledger, max_staleness=0, weight_sync_interval=1)
    batch, stale, _, launched = on_policy.next_batch(0, collect)
    assert launched == 0 and stale == [0, 0] and all(s.meta["staleness"] == 0 for s in batch)
    assert on_policy.launch_ceiling() == 1  # max_staleness 0: step 1 trains under the next version
    one_off = PrefetchingController(inner, engine, ledger, max_staleness=1, weight_sync_interval=1)
    one_off.next_batch(0, collect)
    assert one_off.launch_ceiling() == 2 and not one_off.launch(2, collect)  # only the next collect, 1
    Threaded.gate = threading.Event()
    try:
        assert one_off.launch(1, collect) and one_off.in_flight == 1
        with pytest.raises(SyncRefusedError, match="quiesce"):
            one_off.sync_weights(InProcessSync(config=cfg), actor)
        Threaded.gate.set()
        one_off.quiesce()
        version, _ = one_off.sync_weights(InProcessSync(config=cfg), actor)
    finally:
        Threaded.gate.set()
        Threaded.gate = None
    batch, stale, _, launched = one_off.next_batch(1, collect)  # collected under version 0, trained under 1
    assert version == 1 and launched == 0 and stale == [1, 1] and batch[0].meta["staleness"] == 1
    one_off.close()
    on_policy.close()
    engine.close()
    actor.close()



class Demonstrating(Threaded):
    """A controller with demonstrations of its own: the warm start must train on them (an agent's tool
    traces), not on the plain prompt -> answer pairs."""

    warm: list[int] = []

    def warm_start_samples(self, prompts):
        Demonstrating.warm.append(len(prompts))
        return sft_samples(prompts, self.tokenizer)


class DemonstratingPlugin:
    @hookimpl
    def unirl_rollout_controllers(self):
        return {"demonstrating": Demonstrating}


def test_sft_only_run_trains_on_the_controllers_demonstrations(tmp_path):
    """`unirl sft` (train(rl=False)) builds the recipe's controller and takes its warm-start samples, as
    `unirl train` does: without it, an agentic recipe's warm start silently trained on prompt -> answer
    pairs and exported a model that never calls its tool."""
    Demonstrating.warm.clear()
    cfg = config(tmp_path, "rollout.controller=demonstrating", "rollout.mode=sync", "sft.steps=3",
                 "sft.batch_size=4", "run.name=sft-only")
    result = train(cfg, load_kernel(extra=[("demonstrating", DemonstratingPlugin())]), rl=False)
    assert Demonstrating.warm == [4, 4, 4]  # one call per SFT step, each with the step's batch
    assert result.steps_done == 0
