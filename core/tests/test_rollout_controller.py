"""The rollout-controller seam (``unirl_rollout_controllers`` / ``rollout.controller``): the trainer drives
a plugin's controller for training, eval and the SFT warm start and closes it; preflight names the fixes;
multi-token stop strings reach the engine as text; ``PromptCursor.next(k)``."""

from __future__ import annotations

from pathlib import Path

import pytest

from unirl.config import load_config
from unirl.contracts import RolloutController, SamplingParams
from unirl.data.datasets import PromptCursor
from unirl.kernel import load_kernel
from unirl.kernel.errors import PreflightError
from unirl.kernel.hookspecs import hookimpl
from unirl.preflight import check
from unirl.rewards.builtin import score
from unirl.samples import Sample, expand
from unirl.trainer.loop import sft_samples, stop_token_ids, train

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "sft.steps=3", "sft.batch_size=8", "trainer.steps=2", "trainer.prompts_per_step=4", "trainer.eval_every=0",
    "trainer.progress=false", "trainer.plot=false", "trainer.export_hf=false", "data.arith.n_train=64",
    "data.arith.n_eval=6", "trainer.eval_k=2", "rollout.n=4", "rollout.max_new_tokens=4",
    "model.build={hidden_size: 64, intermediate_size: 128}",
]


class Recording(RolloutController):
    """One engine call per collect, through the engine's contract; records what the trainer asked."""

    log: list[tuple[str, str, int, int, int]] = []
    closed: list[str] = []

    def __init__(self, *, config, engine, tokenizer, reward_fn, kernel, tag, base_seed):
        self.engine, self.tokenizer, self.reward_fn, self.tag, self.base_seed = engine, tokenizer, reward_fn, tag, base_seed
        assert kernel.get("rewards", config.reward.name) is not None  # the trainer's own kernel
        self.calls = 0

    def collect(self, draw, *, groups, n, sampling, launch_tag):
        self.calls += 1
        prompts = draw(groups)
        assert len({p.id for p in prompts}) == len(prompts) == groups or self.tag == "eval"
        slots = expand(prompts, n, tag=f"{self.tag}{self.calls}", base_seed=self.base_seed)
        self.engine.generate(slots, sampling)
        score(slots, self.reward_fn)
        Recording.log.append(("collect", self.tag, groups, n, len(slots)))
        return slots

    def metrics(self):
        return {"recording/calls": float(self.calls)}

    def warm_start_samples(self, prompts):
        Recording.log.append(("warm_start", self.tag, len(prompts), 0, 0))
        return sft_samples(prompts, self.tokenizer)

    def close(self):
        Recording.closed.append(self.tag)


class Plugin:
    @hookimpl
    def unirl_rollout_controllers(self):
        return {"recording": Recording, "not_a_controller": lambda **_: object()}


def config(tmp_path, *extra):
    return load_config(ROOT / "recipes" / "arith-tiny.yaml", [*SMALL, f"run.output_dir={tmp_path}", *extra])


def kernel():
    return load_kernel(extra=[("recording", Plugin())])


@pytest.mark.slow
def test_trainer_drives_the_controller_for_training_eval_and_warm_start_and_closes_it(tmp_path):
    Recording.log.clear()
    Recording.closed.clear()
    result = train(config(tmp_path, "rollout.controller=recording"), kernel())
    assert result.steps_done == 2
    log = Recording.log
    # SFT traces come from the (train) controller, one call per SFT step
    assert [e for e in log if e[0] == "warm_start"] == [("warm_start", "train", 8, 0, 0)] * 3
    collects = [e for e in log if e[0] == "collect"]
    # eval before, 2 train steps, eval after (the last step): eval through its own controller
    assert collects == [("collect", "eval", 6, 2, 12), ("collect", "train", 4, 4, 16),
                        ("collect", "train", 4, 4, 16), ("collect", "eval", 6, 2, 12)]
    assert [h["recording/calls"] for h in result.history if h["step"] > 0] == [1.0, 2.0]
    assert "eval_recording/calls" in result.history[0]
    assert sorted(Recording.closed) == ["eval", "train"]  # Components.close closed both


def test_preflight_names_the_controller_fixes(tmp_path):
    k = kernel()
    with pytest.raises(PreflightError) as e:  # an environment nobody can run
        check(config(tmp_path, "rollout.environment=recording"), k)
    assert "rollout.controller" in str(e.value) and "set rollout.controller" in str(e.value)
    check(config(tmp_path, "rollout.controller=recording", "rollout.mode=async"), k)  # PrefetchingController
    with pytest.raises(PreflightError) as e:
        check(config(tmp_path, "rollout.controller=nope"), k)
    assert "rollout.controller" in str(e.value) and "recording" in str(e.value)
    with pytest.raises(PreflightError) as e:
        check(config(tmp_path, "rollout.controller=not_a_controller"), k)
    assert "not a RolloutController subclass" in str(e.value)
    check(config(tmp_path, "rollout.controller=recording"), k)  # the good one passes


def test_multi_token_stop_strings_go_to_sampling_stop(tmp_path):
    c = config(tmp_path, "rollout.stop=['</tool_call>', '=']")
    adapter = load_kernel().build("model_adapters", c.model.adapter)
    tok = adapter.build_tokenizer(c)
    assert len(tok.encode("</tool_call>", add_special_tokens=False)) > 1  # the case that used to raise
    (nl,) = tok.encode("=", add_special_tokens=False)
    ids = stop_token_ids(c, tok)
    assert ids == [tok.eos_token_id, nl]
    sp = SamplingParams.from_config(c, ids)
    assert sp.stop == ("</tool_call>", "=") and sp.stop_token_ids == (tok.eos_token_id, nl)


def _prompts(n):
    return [Sample(id=f"p{i}", prompt_ids=[i], prompt_text=str(i), answer=i) for i in range(n)]


def test_prompt_cursor_next_k_never_repeats_within_a_draw_and_resumes():
    a = PromptCursor(_prompts(10), 4, seed=3)
    draws = [a.next(k) for k in (3, 4, 5, 1, 10)]
    for d, k in zip(draws, (3, 4, 5, 1, 10), strict=True):
        assert len(d) == k and len({s.id for s in d}) == k
    assert {s.id for s in draws[0] + draws[1]} <= {f"p{i}" for i in range(10)}
    assert not {s.id for s in draws[0]} & {s.id for s in draws[1]}  # same epoch: disjoint
    b = PromptCursor(_prompts(10), 4, seed=3)
    b.next(3)
    c = PromptCursor(_prompts(10), 4, seed=3)
    c.load_state_dict(b.state_dict())
    assert [s.id for s in c.next(4)] == [s.id for s in draws[1]]
    assert [s.id for s in PromptCursor(_prompts(10), 4, seed=3).next_batch()] == \
        [s.id for s in PromptCursor(_prompts(10), 4, seed=3).next(4)]
    with pytest.raises(ValueError, match="k=11"):
        a.next(11)
