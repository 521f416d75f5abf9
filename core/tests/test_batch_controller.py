"""``rollout.controller: batch``, core's default: what the old no-controller path did, now one controller.

The oracle for "nothing changed" is the old path itself, written out here: ``expand`` under the
trainer's tag and seed, one ``generate``, ``score``. The collect must give the same ids, seeds, tokens
and rewards. Engine failures are named (engine, launch) and restartable; an interrupt passes through.
"""

from __future__ import annotations

import pytest

from unirl.config import RunConfig
from unirl.contracts import NullTracer, RolloutController, SamplingParams
from unirl.engine.torch_engine import TorchEngine
from unirl.kernel import load_kernel
from unirl.kernel.errors import UniRLError, WorkerLostError
from unirl.models.qwen3 import Qwen3Adapter
from unirl.models.tokenizer import build_demo_tokenizer
from unirl.rewards.builtin import exact_int, score
from unirl.rollout.batch import BatchController, EngineFailedError, sft_samples
from unirl.samples import Sample, eval_seed, expand
from unirl.testing import default_runtime

CONFIG = RunConfig(model={"build": {"hidden_size": 64, "intermediate_size": 128}})
SAMPLING = SamplingParams(max_new_tokens=5)


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


@pytest.fixture(scope="module")
def engine(tok):
    eng = TorchEngine(config=CONFIG, runtime=default_runtime(CONFIG), adapter=Qwen3Adapter(), tokenizer=tok)
    yield eng
    eng.close()


def prompts(tok, k=3):
    return [Sample(id=f"p{i}", prompt_ids=tok.encode(f"Q: {i}+{i}=? A:"), answer=2 * i) for i in range(k)]


def test_batch_is_the_default_controller_and_is_registered():
    assert RunConfig().rollout.controller == "batch"
    assert issubclass(load_kernel().get("rollout_controllers", "batch").load(), RolloutController)


@pytest.mark.parametrize("tag", ["train", "eval"])
def test_collect_is_the_old_expand_generate_score_path(tok, engine, tag):
    seed = eval_seed(0) if tag == "eval" else 0
    ctl = BatchController(config=CONFIG, engine=engine, tokenizer=tok, reward_fn=exact_int, tag=tag, base_seed=seed)
    got = ctl.collect(lambda k: prompts(tok, k), groups=3, n=2, sampling=SAMPLING, launch_tag="train-7")
    want = expand(prompts(tok), 2, tag="train-7", base_seed=seed, seed_tag="eval" if tag == "eval" else None)
    engine.generate(want, SAMPLING)
    score(want, exact_int)
    assert [s.id for s in got] == [s.id for s in want] and [s.seed for s in got] == [s.seed for s in want]
    assert [s.response_ids for s in got] == [s.response_ids for s in want]
    assert [s.reward for s in got] == [s.reward for s in want] and ctl.metrics() == {} and ctl.state_dict() == {}
    if tag == "eval":  # evals at two steps sample a prompt under the same seeds (fresh ids)
        again = ctl.collect(lambda k: prompts(tok, k), groups=3, n=2, sampling=SAMPLING, launch_tag="eval-9")
        assert [s.seed for s in again] == [s.seed for s in got] and again[0].id != got[0].id


def test_warm_start_is_the_gold_answer_then_eos(tok, engine):
    ctl = BatchController(config=CONFIG, engine=engine, tokenizer=tok, reward_fn=exact_int)
    (s,) = ctl.warm_start_samples(prompts(tok, 2)[1:])
    assert s.response_ids == tok.encode(" 2", add_special_tokens=False) + [tok.eos_token_id]
    assert s.loss_mask == [1] * len(s.response_ids) and sft_samples(prompts(tok, 2)[1:], tok)[0].response_ids == s.response_ids


def test_a_controller_without_a_tokenizer_still_collects(tok, engine):
    """An engine that detokenizes itself (vLLM with its own tokenizer) is driven with ``tokenizer=None``:
    only the warm start needs one, so building the controller and collecting must not (CI caught a
    constructor that read ``tokenizer.eos_token_id``)."""
    ctl = BatchController(config=CONFIG, engine=engine, tokenizer=None, reward_fn=exact_int, base_seed=0)
    out = ctl.collect(lambda k: prompts(tok, 2)[:k], groups=2, n=2, sampling=SamplingParams(max_new_tokens=3),
                      launch_tag="train-0")
    assert len(out) == 4 and all(s.response_ids for s in out)


class Failing(TorchEngine):
    error: BaseException = ConnectionError("engine worker process exited (SIGKILL)")

    def generate(self, samples, sampling):
        raise self.error


def test_an_engine_failure_names_the_engine_and_the_launch_and_is_restartable(tok):
    eng = Failing(config=CONFIG, runtime=default_runtime(CONFIG), adapter=Qwen3Adapter(), tokenizer=tok)
    scored: list[str] = []
    ctl = BatchController(config=CONFIG, engine=eng, tokenizer=tok,
                          reward_fn=lambda completion, sample: scored.append(sample.id) or 0.0)
    try:
        with pytest.raises(EngineFailedError, match=r"rollout engine 'torch' failed launch train-4 \(6 samples") as e:
            ctl.collect(lambda k: prompts(tok, k), groups=3, n=2, sampling=SAMPLING, launch_tag="train-4")
        assert isinstance(e.value, WorkerLostError) and "SIGKILL" in str(e.value) and "run.resume=true" in str(e.value)
        assert scored == []  # nothing of a failed launch is scored
        Failing.error = UniRLError("replica 1 lost")  # an engine's own named error passes unchanged
        with pytest.raises(UniRLError, match="^replica 1 lost$"):
            ctl.collect(lambda k: prompts(tok, k), groups=1, n=1, sampling=SAMPLING, launch_tag="train-5")
        Failing.error = KeyboardInterrupt()  # Ctrl-C is never wrapped
        with pytest.raises(KeyboardInterrupt):
            ctl.collect(lambda k: prompts(tok, k), groups=1, n=1, sampling=SAMPLING, launch_tag="train-6")
    finally:
        eng.close()


def test_the_null_tracer_records_nothing_and_writes_nothing():
    t = NullTracer()
    t.record(phase="train", step=0, version=0, samples=[])
    assert t.close() is None
