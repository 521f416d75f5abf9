"""Reward ``reward_model`` (a tiny sequence-classification Qwen3 built by code) and reward preflight."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.config import load_config
from unirl.kernel import load_kernel
from unirl.kernel.errors import Violation
from unirl.preflight import preflight
from unirl.rewards.build import build_reward
from unirl.rewards.builtin import score
from unirl.rewards.reward_model import RewardModelReward
from unirl.samples import Sample

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, max_position_embeddings=128)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from unirl.models.tokenizer import build_demo_tokenizer, save_tokenizer

    out = tmp_path_factory.mktemp("rm") / "hf"
    tok = build_demo_tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForSequenceClassification(Qwen3Config(vocab_size=len(tok), num_labels=2, pad_token_id=tok.pad_token_id,
                                                       eos_token_id=tok.eos_token_id, **TINY))
    model.save_pretrained(out)
    save_tokenizer(tok, out)
    return out


def samples(completions):
    return [Sample(id=f"p0@t-0/{i}", prompt_ids=[1], prompt_text="Q: 2+2=? A:", answer=4, status="ok") for i in
            range(len(completions))]


def reference(rm_dir, texts, label):
    """Oracle: each text alone, no padding, float64, straight from transformers."""
    from transformers import AutoModelForSequenceClassification

    from unirl.models.tokenizer import load_tokenizer

    tok = load_tokenizer(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float64).eval()
    out = []
    for t in texts:
        ids = torch.tensor([tok.encode(t, add_special_tokens=False)])
        with torch.no_grad():
            out.append(float(model(input_ids=ids).logits[0, label]))
    return out


def test_batched_scores_equal_one_at_a_time(rm_dir):
    comps = [" 4", " 5 and more text here", "", " 4444444444", " four"]
    cfg = load_config(None, ["reward.name=reward_model", f"reward.reward_model.path={rm_dir}",
                             "reward.reward_model.batch_size=2", "reward.reward_model.label=1"])
    rm = build_reward(cfg, load_kernel())
    assert isinstance(rm, RewardModelReward)
    got = rm.score_batch(comps, samples(comps))
    assert rm.calls == 3  # 5 texts in micro-batches of 2
    want = reference(rm_dir, [f"Q: 2+2=? A:{c}" for c in comps], label=1)
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(x, 6) for x in got)) == len(got), "distinct texts score differently"


@pytest.mark.parametrize("mode", ["sigmoid", "batch", "running"])
def test_normalisation(rm_dir, mode):
    comps = [" 1", " 22", " 333", " 4444"]
    base = load_config(None, ["reward.name=reward_model", f"reward.reward_model.path={rm_dir}"])
    raw = build_reward(base, load_kernel()).score_batch(comps, samples(comps))
    cfg = load_config(None, ["reward.name=reward_model", f"reward.reward_model.path={rm_dir}",
                             f"reward.reward_model.normalize={mode}"])
    rm = build_reward(cfg, load_kernel())
    got = rm.score_batch(comps, samples(comps))
    if mode == "sigmoid":
        assert got == pytest.approx([1 / (1 + math.exp(-r)) for r in raw])
    elif mode == "batch":
        mean = sum(raw) / 4
        std = math.sqrt(sum((r - mean) ** 2 for r in raw) / 4)
        assert got == pytest.approx([(r - mean) / std for r in raw])
    else:  # running: the second batch is normalised with the stats of both batches
        more = [" 5", " 66"]
        raw2 = build_reward(base, load_kernel()).score_batch(more, samples(more))
        got2 = rm.score_batch(more, samples(more))
        seen = raw + raw2
        mean = sum(seen) / 6
        std = math.sqrt(sum((r - mean) ** 2 for r in seen) / 6)
        assert got2 == pytest.approx([(r - mean) / std for r in raw2])


def test_too_long_text_fails_its_sample_only(rm_dir):
    cfg = load_config(None, ["reward.name=reward_model", f"reward.reward_model.path={rm_dir}",
                             "reward.reward_model.max_tokens=20"])
    rm = build_reward(cfg, load_kernel())
    batch = samples([" 4", " " + "9" * 40])
    for s, c in zip(batch, [" 4", " " + "9" * 40], strict=True):
        s.response_text = c
    assert score(batch, rm) == {"scored": 1, "failed": 1, "skipped": 0}
    assert "max_tokens 20" in batch[1].meta["error"] and math.isfinite(batch[0].reward)


def fields(violations: list[Violation]) -> dict[str, str]:
    out: dict[str, str] = {}
    for v in violations:
        out[v.field] = f"{out.get(v.field, '')} | {v.message}"
    return out


def test_preflight_names_the_broken_fields(rm_dir, tmp_path):
    k = load_kernel()
    got = fields(preflight(load_config(None, ["reward.name=judge", "reward.judge.template='{prompt} {answr}'",
                                              "reward.judge.engine=nope", "reward.judge.options={batch_size: 0}"]), k))
    assert "does not read" not in str(got)
    assert "unknown fields ['answr']" in got["reward.judge.template"]
    assert "no {completion} field" in str(got)
    assert "nope" in got["reward.judge.engine"]
    assert "needs a model directory" in got["reward.judge.model.path"]
    got = fields(preflight(load_config(None, ["reward.name=judge", f"reward.judge.model.path={tmp_path}",
                                              "reward.judge.options={batch_size: 0}"]), k))
    assert "no config.json" in got["reward.judge.model.path"]
    assert "reward.judge.options.batch_size" in got
    got = fields(preflight(load_config(None, ["reward.name=judge", f"reward.judge.model.path={rm_dir}",
                                              "reward.judge.chat_template=true", "reward.judge.max_prompt_tokens=500"]), k))
    assert "no chat template" in got["reward.judge.chat_template"]
    assert "exceeds the judge's context (128)" in got["reward.judge.max_prompt_tokens"]
    got = fields(preflight(load_config(None, ["reward.name=reward_model", f"reward.reward_model.path={rm_dir}",
                                              "reward.reward_model.label=2", "reward.reward_model.template='{completion'"]), k))
    assert "the head has 2 label(s)" in got["reward.reward_model.label"]
    assert "does not parse" in got["reward.reward_model.template"]
    got = fields(preflight(load_config(None, ["reward.name=weighted", "reward.terms={exact_int: 1.0, nosuch: 2.0, "
                                              "weighted: 1.0}", f"reward.reward_model.path={rm_dir}"]), k))
    assert "nosuch" in got["reward.terms.nosuch"] and "cannot itself be 'weighted'" in got["reward.terms.weighted"]
    assert "does not read it" in got["reward.reward_model"]
    got = fields(preflight(load_config(None, ["reward.judge.timeout_s=3"]), k))
    assert "reward 'exact_int' does not read it" in got["reward.judge"]
    assert not [v for v in preflight(load_config(None, ["reward.name=reward_model", f"reward.reward_model.path={rm_dir}"]), k)
                if v.field.startswith("reward")]
