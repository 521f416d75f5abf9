"""The judge reward on the real embedded engine: batching, caching, failures as NaN, composition, preflight.

The judge model is a tiny Qwen3 built by code and saved like any HF directory (random weights: these
tests are about the plumbing, so the verdict rule reads its raw output). Failure injection subclasses
the real :class:`TorchEngine` (one that raises, one that stalls until aborted), registered as engines.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from unirl.algorithms.advantages import grpo
from unirl.config import AlgorithmSection, load_config
from unirl.engine.torch_engine import TorchEngine
from unirl.kernel import load_kernel
from unirl.kernel.hookspecs import hookimpl
from unirl.rewards.build import build_reward, reward_term_metrics
from unirl.rewards.builtin import score
from unirl.rewards.judge import JudgeReward
from unirl.samples import Sample

SMALL_BUILD = "{hidden_size: 32, intermediate_size: 64, num_attention_heads: 2, num_key_value_heads: 1, head_dim: 16}"


class Recording(TorchEngine):
    """The real engine, recording each submit's size; it raises for a 'BOOM' prompt and stalls
    (until aborted) for a 'SLOW' one."""

    submits: list[int] = []

    def submit(self, samples, sampling):
        Recording.submits.append(len(samples))
        return super().submit(samples, sampling)

    merges_jobs = False  # its _run is the point: every job runs through it (no merged batches)

    def _run(self, samples, sampling, should_stop, version):
        if any("BOOM" in s.prompt_text for s in samples):
            raise RuntimeError("judge server crashed")
        if any("SLOW" in s.prompt_text for s in samples):
            stop = threading.Event()
            while not should_stop() and not stop.wait(0.01):
                pass
            for s in samples:
                s.append_model_turn([], [], version, "abort")
            return
        super()._run(samples, sampling, should_stop, version)


class Engines:
    @hookimpl
    def unirl_rollout_engines(self):
        return {"recording": Recording}


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    """A tiny random Qwen3 + the demo tokenizer, saved as an HF directory (what reward.judge.model.path names)."""
    from unirl.models.qwen3 import Qwen3Adapter
    from unirl.models.tokenizer import save_tokenizer

    out = tmp_path_factory.mktemp("judge") / "hf"
    cfg = load_config(None, [f"model.build={SMALL_BUILD}"])
    adapter = Qwen3Adapter()
    tok = adapter.build_tokenizer(cfg)
    adapter.build_model(cfg, tok).save_pretrained(out)
    save_tokenizer(tok, out)
    return out


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    Recording.submits = []
    yield
    torch.set_num_threads(before)


def kernel():
    k = load_kernel()
    k.register(Engines(), entry_point="recording", dist="test-recording", version="0")
    return k


def judge_config(judge_dir, *extra):
    # random weights: every output that holds a letter a-m scores 1, any other output 0 (never unparsed)
    return load_config(None, ["reward.name=judge", f"reward.judge.model.path={judge_dir}",
                              "reward.judge.engine=recording", "reward.judge.sampling.max_new_tokens=4",
                              "reward.judge.verdict.negative=[]", "reward.judge.verdict.positive=['[a-m]']",
                              "reward.judge.verdict.unparsed=zero", *extra])


def batch(texts, completions):
    samples = [Sample(id=f"p{i}@train-0/{j}", prompt_ids=[5], prompt_text=t, answer=7, response_text=c,
                      response_ids=[9, 1], loss_mask=[1, 1], rollout_logprobs=[-0.1, -0.2], versions=[0, 0],
                      status="ok")
               for i, t in enumerate(texts) for j, c in enumerate(completions)]
    return samples


def test_one_engine_call_per_rollout_batch_and_cache(judge_dir):
    judge = build_reward(judge_config(judge_dir), kernel())
    try:
        assert isinstance(judge, JudgeReward)
        samples = batch([f"Q: {i}+1=? A:" for i in range(6)], [" 1", " 2", " 3", " 1"])  # 24, 18 distinct
        stats = score(samples, judge)
        assert stats == {"scored": 24, "failed": 0, "skipped": 0}
        assert Recording.submits == [18], "one submit for the whole batch, deduplicated"
        first = [s.reward for s in samples]
        assert set(first) <= {0.0, 1.0}
        again = batch([f"Q: {i}+1=? A:" for i in range(6)], [" 1", " 2", " 3", " 1"])
        score(again, judge)
        assert Recording.submits == [18], "every verdict came from the cache"
        assert [s.reward for s in again] == first and judge.hits == 24
        mixed = batch(["Q: 0+1=? A:", "Q: 9+9=? A:"], [" 1", " 5"])  # 1 cached, 3 new
        score(mixed, judge)
        assert Recording.submits == [18, 3]
    finally:
        judge.close()


def test_cache_key_holds_the_judge_version(judge_dir):
    k = kernel()
    a = build_reward(judge_config(judge_dir, "reward.judge.version=v1"), k)
    b = build_reward(judge_config(judge_dir, "reward.judge.version=v2"), k)
    c = build_reward(judge_config(judge_dir, "reward.judge.template='{prompt} => {completion}'"), k)
    try:
        s = batch(["Q: 1+1=? A:"], [" 2"])[0]
        assert a.key("x") != b.key("x") and a.version == "v1"
        assert c.version != build_reward(judge_config(judge_dir), k).version  # derived: the template is in it
        assert a.score_batch([" 2"], [s]) == a.score_batch([" 2"], [s]) and len(a.cache) == 1
        assert Recording.submits == [1]  # the second call was cached
        off = build_reward(judge_config(judge_dir, "reward.judge.cache_size=0"), k)
        off.score_batch([" 2"], [s]), off.score_batch([" 2"], [s])
        assert Recording.submits == [1, 1, 1] and not off.cache
        off.close()
    finally:
        a.close(), b.close(), c.close()


def _advantages(samples):
    return [a.tolist() for a in grpo(samples, options={}, algorithm=AlgorithmSection()).advantages]


@pytest.mark.parametrize("fault", ["SLOW", "BOOM"])
def test_judge_timeout_or_error_is_nan_and_leaves_the_group_alone(judge_dir, fault):
    """Three siblings are scored (the judge caches them); the fourth's judge call times out / raises:
    it is NaN (failed, zero advantage) and the others' advantages equal those of the group without it."""
    cfg = judge_config(judge_dir, "reward.name=weighted", "reward.terms={exact_int: 1.0, judge: 0.5}",
                       "reward.judge.timeout_s=0.5")
    reward = build_reward(cfg, kernel())
    try:
        group = batch(["Q: 3+4=? A:"], [" 7", " 8", " 7 ok", " 9"])
        group[3].prompt_text = f"Q: 3+4=? A: {fault}"
        score(group[:3], reward)  # the three healthy ones, judged and cached
        alone = _advantages([s.copy() for s in group[:3]])
        stats = score(group, reward)
        assert stats["failed"] == 1 and stats["scored"] == 3
        bad = group[3]
        assert math.isnan(bad.reward) and bad.status == "failed"
        why = "timed out" if fault == "SLOW" else "judge engine raised RuntimeError: judge server crashed"
        assert why in bad.meta["error"] and "reward term 'judge' failed" in bad.meta["error"]
        assert [s.meta["reward_terms"]["exact_int"] for s in group[:3]] == [1.0, 0.0, 1.0]
        adv = _advantages(group)
        assert adv[:3] == alone and adv[3] == [0.0, 0.0]
        assert len({s.reward for s in group[:3]}) > 1, "the healthy rewards differ, so the check has teeth"
    finally:
        reward.close()


def test_unparsable_verdict_fails_the_sample_unless_configured(judge_dir):
    k = kernel()
    strict = build_reward(judge_config(judge_dir, "reward.judge.verdict.positive=['^zzz$']",
                                       "reward.judge.verdict.unparsed=fail"), k)
    lenient = build_reward(judge_config(judge_dir, "reward.judge.verdict.positive=['^zzz$']"), k)
    try:
        s = batch(["Q: 1+1=? A:"], [" 2"])
        assert score(s, strict)["failed"] == 1 and "not parsable" in s[0].meta["error"]
        s = batch(["Q: 1+1=? A:"], [" 2"])
        assert score(s, lenient)["scored"] == 1 and s[0].reward == 0.0
        long = batch(["Q: " + "1+" * 400 + "1=? A:"], [" 2"])
        assert score(long, strict)["failed"] == 1 and "max_prompt_tokens" in long[0].meta["error"]
    finally:
        strict.close(), lenient.close()


def test_weighted_sum_and_its_terms(judge_dir):
    cfg = judge_config(judge_dir, "reward.name=weighted", "reward.terms={exact_int: 2.0, judge: -0.5}")
    reward = build_reward(cfg, kernel())
    try:
        samples = batch(["Q: 3+4=? A:", "Q: 1+6=? A:"], [" 7", " 6"])
        score(samples, reward)
        for s in samples:
            t = s.meta["reward_terms"]
            assert set(t) == {"exact_int", "judge"}
            assert s.reward == pytest.approx(2.0 * t["exact_int"] - 0.5 * t["judge"])
        m = reward_term_metrics(samples)
        assert m["reward/exact_int"] == 0.5
        assert m["reward/judge"] == pytest.approx(sum(s.meta["reward_terms"]["judge"] for s in samples) / 4)
        assert Recording.submits == [4], "the judge term is one call for the batch"
    finally:
        reward.close()


def test_training_against_the_judge_logs_each_term(judge_dir, tmp_path):
    """The trainer scores through the batch seam: one judge call per rollout batch, terms logged."""
    from pathlib import Path

    from unirl.trainer.loop import train

    rollouts = []

    class Spy:
        @hookimpl
        def unirl_on_rollout(self, phase, samples):
            rollouts.append((phase, len(samples)))

    k = kernel()
    k.register(Spy(), entry_point="spy", dist="test-spy", version="0")
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "arith-tiny.yaml"
    cfg = load_config(recipe, [
        "sft.steps=0", "trainer.steps=2", "trainer.prompts_per_step=4", "trainer.eval_every=0", "trainer.eval_k=1",
        "trainer.progress=false", "trainer.plot=false", "trainer.export_hf=false", "data.arith.n_train=64",
        "data.arith.n_eval=4", "rollout.n=4", "rollout.max_new_tokens=4", f"model.build={SMALL_BUILD}",
        f"run.output_dir={tmp_path}", "reward.name=weighted", "reward.terms={exact_int: 1.0, judge: 0.25}",
        f"reward.judge.model.path={judge_dir}", "reward.judge.engine=recording",
        "reward.judge.sampling.max_new_tokens=3", "reward.judge.verdict.negative=[]",
        "reward.judge.verdict.positive=['[a-m]']", "reward.judge.verdict.unparsed=zero"])
    result = train(cfg, k)
    assert result.steps_done == 2
    assert [n for _, n in rollouts] == [4, 16, 16, 4]  # eval, two train steps, eval
    assert 1 <= len(Recording.submits) <= len(rollouts), "never more than one judge call per rollout batch"
    assert sum(Recording.submits) > len(Recording.submits), "each call carries many samples"
    for m in result.history[1:]:
        assert {"reward/exact_int", "reward/judge"} <= set(m) and m["failed"] == 0


class NotABatchReward:
    def __init__(self, **kwargs):
        pass


class Rewards:
    @hookimpl
    def unirl_rewards(self):
        return {"classy": NotABatchReward}


def test_a_reward_class_must_be_a_batch_reward(judge_dir):
    from unirl.preflight import preflight

    k = kernel()
    k.register(Rewards(), entry_point="classy", dist="test-classy", version="0")
    got = [v for v in preflight(load_config(None, ["reward.name=classy"]), k) if v.field == "reward.name"]
    assert got and "not a unirl.contracts.BatchReward subclass" in got[0].message
    with pytest.raises(Exception, match="not a unirl.contracts.BatchReward"):
        build_reward(load_config(None, ["reward.name=classy"]), k)
