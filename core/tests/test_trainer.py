"""The embedded loop end to end: it runs, it resumes bit for bit, it survives a bad reward, it learns."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from unirl.config import load_config
from unirl.kernel import load_kernel
from unirl.kernel.hookspecs import hookimpl
from unirl.trainer.loop import train
from unirl.trainer.preempt import Preempted

ROOT = Path(__file__).resolve().parents[2]

SMALL = [
    "sft.steps=20", "sft.batch_size=16", "trainer.steps=6", "trainer.prompts_per_step=4",
    "trainer.eval_every=0", "trainer.progress=false", "trainer.plot=false", "data.arith.n_train=64",
    "data.arith.n_eval=8", "rollout.n=4", "rollout.max_new_tokens=4", "model.build={hidden_size: 64, intermediate_size: 128}",
]


def small_config(tmp_path, name, *extra):
    return load_config(ROOT / "recipes" / "arith-tiny.yaml", [*SMALL, f"run.output_dir={tmp_path}", f"run.name={name}", *extra])


def weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt_dir.glob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(f).items()})
    assert out, f"no safetensors in {ckpt_dir}"
    return out


class KillAfter:
    """SIGTERM to this process at the end of RL step ``step`` (1-based): the run is killed there the way a
    cluster preempts it, through the trainer's own signal handling (finish the step, checkpoint, exit)."""

    def __init__(self, step: int):
        self.step = step

    @hookimpl
    def unirl_on_step_end(self, step, metrics, config):
        if step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_resume_is_bit_exact(tmp_path):
    straight = train(small_config(tmp_path, "straight"), load_kernel())
    assert straight.steps_done == 6

    with pytest.raises(Preempted, match="preempted at step 3"):
        train(small_config(tmp_path, "resumed", "trainer.save_every=3"), load_kernel(extra=[("kill", KillAfter(3))]))
    assert (tmp_path / "resumed" / "checkpoints" / "latest").read_text().strip() == "step_000003"
    with open(tmp_path / "resumed" / "metrics.jsonl", "a") as f:  # a step logged but never checkpointed
        f.write(json.dumps({"step": 4, "reward": 99.0}) + "\n" + '{"step": 5, "rew')  # + a torn line
    second = train(small_config(tmp_path, "resumed", "run.resume=true"), load_kernel())
    assert second.steps_done == 6

    a = weights(tmp_path / "straight" / "checkpoints" / "step_000006")
    b = weights(tmp_path / "resumed" / "checkpoints" / "step_000006")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    rewards = lambda h: [m["reward"] for m in h if m["step"] > 0]  # noqa: E731
    assert rewards(straight.history) == rewards(second.history)
    lines = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "reward" in m] == [1, 2, 3, 4, 5, 6]
    straight_lines = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    untimed = lambda rows: [{k: v for k, v in r.items() if not (k.endswith("_s") or k.startswith("mem/"))} for r in rows]  # noqa: E731
    assert untimed(lines) == untimed(straight_lines), "row for row, the version counter included"
    assert lines == second.history


def test_retention_keeps_last_and_every(tmp_path):
    train(small_config(tmp_path, "keep", "trainer.save_every=1", "trainer.keep_last=2", "trainer.keep_every=3",
                       "sft.steps=0", "trainer.steps=7"), load_kernel())
    root = tmp_path / "keep" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000003", "step_000006", "step_000007"]
    assert (root / "latest").read_text().strip() == "step_000007"


class FlakyReward:
    """A reward plugin that raises on every third call: those samples must be marked failed (NaN)."""

    calls = 0

    @staticmethod
    def fn(completion, sample):
        FlakyReward.calls += 1
        if FlakyReward.calls % 3 == 0:
            raise RuntimeError("grader timed out")
        return 1.0 if completion.strip().startswith(str(sample.answer)) else 0.0

    @hookimpl
    def unirl_rewards(self):
        return {"flaky": FlakyReward.fn}


def test_raising_reward_marks_samples_failed_and_training_goes_on(tmp_path):
    seen = []

    class Spy:
        @hookimpl
        def unirl_on_rollout(self, step, samples):
            seen.append([s.reward for s in samples])

    kernel = load_kernel()
    kernel.register(FlakyReward(), entry_point="flaky", dist="test-flaky", version="0")
    kernel.register(Spy(), entry_point="spy", dist="test-spy", version="0")
    result = train(small_config(tmp_path, "flaky", "reward.name=flaky", "trainer.steps=2", "sft.steps=0"), kernel)
    assert result.steps_done == 2
    flat = [r for step in seen for r in step]
    assert any(math.isnan(r) for r in flat) and any(not math.isnan(r) for r in flat)
    assert all(m["failed"] > 0 for m in result.history if m["step"] > 0)


def test_training_writes_metrics_plot_and_config(tmp_path):
    result = train(small_config(tmp_path, "art", "trainer.steps=2", "trainer.plot=true", "trainer.eval_every=1"), load_kernel())
    run = tmp_path / "art"
    assert (run / "config.yaml").is_file() and (run / "curves.png").stat().st_size > 1000
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"reward", "approx_kl", "entropy", "clip_frac", "grad_norm", "rollout_s", "eval", "version"} <= set(lines[-1])
    assert lines[-1]["version"] == 3  # initial publish + one per step
    assert not math.isnan(result.eval_before) and not math.isnan(result.eval_after)


@pytest.mark.slow
def test_demo_recipe_learns(demo_run):
    """The acceptance bar: held-out avg@4 rises by at least 0.20 from the warm start in <= 60 GRPO steps.

    ``demo_run`` (the repository conftest) is the one embedded demo run of the session.
    """
    config, result = demo_run
    assert config.trainer.steps <= 60 and result.steps_done == config.trainer.steps
    print(f"avg@4 before {result.eval_before:.3f} after {result.eval_after:.3f}")
    assert result.eval_after - result.eval_before >= 0.20


def test_ppo_gae_with_value_head_and_kl_reference(tmp_path):
    result = train(small_config(tmp_path, "ppo", "algorithm.estimator=gae", "actor.value_head=true",
                                "algorithm.kl_coef=0.05", "algorithm.kl_estimator=k1", "trainer.steps=2",
                                "trainer.tensorboard=true"), load_kernel())
    last = result.history[-1]
    assert {"vf_loss", "kl"} <= set(last) and math.isfinite(last["vf_loss"]) and math.isfinite(last["kl"])
    assert list((tmp_path / "ppo" / "tensorboard").glob("events.out.tfevents.*")), "TensorBoard events written"


def test_sft_command_exports_a_model_that_model_path_loads(tmp_path):
    """`unirl sft` warm-starts and exports an HF directory; `model.path` then loads those exact weights."""
    import subprocess
    import sys

    from unirl.models.qwen3 import Qwen3Adapter

    args = [f"run.output_dir={tmp_path}", "run.name=sft", "sft.steps=5", "sft.batch_size=8",
            "trainer.progress=false", "model.build={hidden_size: 64, intermediate_size: 128}"]
    out = subprocess.run([sys.executable, "-m", "unirl.cli", "sft", str(ROOT / "recipes" / "arith-tiny.yaml"), *args],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    hf = tmp_path / "sft" / "hf"
    assert (hf / "config.json").is_file() and list(hf.glob("*.safetensors"))
    config = load_config(None, [f"model.path={hf}"])
    adapter = Qwen3Adapter()
    tok = adapter.build_tokenizer(config)
    model = adapter.build_model(config, tok)
    fresh = adapter.build_model(load_config(None, ["model.build={hidden_size: 64, intermediate_size: 128}"]), tok)
    ids = torch.tensor([tok.encode("Q: 3+4=? A:", add_special_tokens=False)])
    assert not torch.equal(model(ids).logits, fresh(ids).logits), "the SFT weights were loaded, not a fresh init"
    assert len(tok) == model.config.vocab_size


def test_fresh_run_keeps_an_earlier_run_directory(tmp_path):
    cfg = small_config(tmp_path, "again", "trainer.steps=1", "sft.steps=0")
    train(cfg, load_kernel())
    train(cfg, load_kernel())
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("again.")]
    assert len(kept) == 1 and (kept[0] / "metrics.jsonl").is_file()
    lines = (tmp_path / "again" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2, "the new run's metrics start clean (eval at step 0 + one step)"


def test_worker_env_reaches_components_that_start_processes(tmp_path):
    """Every plugin's unirl_worker_env reaches engines and actors through the one runtime."""
    from unirl.engine.torch_engine import TorchEngine
    from unirl.trainer.loop import build_components

    got = {}

    class EnvEngine(TorchEngine):
        def __init__(self, *, runtime, **kwargs):
            got.update(runtime.worker_env)
            super().__init__(runtime=runtime, **kwargs)

    class Plugin:
        @hookimpl
        def unirl_rollout_engines(self):
            return {"env-engine": EnvEngine}

        @hookimpl
        def unirl_worker_env(self, config):
            return {"UNIRL_PARITY_ENABLE": "1"}

    kernel = load_kernel()
    kernel.register(Plugin(), entry_point="envp", dist="test-envp", version="0")
    c = build_components(small_config(tmp_path, "env", "rollout.engine=env-engine"), kernel)
    try:
        assert got == {"UNIRL_PARITY_ENABLE": "1"}
        assert c.actor.runtime is c.engine.runtime  # one runtime (one kernel) for every component
    finally:
        c.close()


def test_each_phase_is_a_range_in_a_torch_profile(tmp_path):
    """``torch.profiler`` sees the step's phases as ranges (``unirl.rollout`` / ``replay`` / ``train`` /
    ``sync``), once per step, and the train range holds the backward: what ``benchmarks/step_profile.py``
    splits its tables by."""
    from torch.profiler import ProfilerActivity, profile

    cfg = small_config(tmp_path, "prof", "trainer.steps=2", "sft.steps=0")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train(cfg, load_kernel())
    events = prof.events()
    ranges = {name: [e for e in events if e.name == name] for name in
              ("unirl.rollout", "unirl.replay", "unirl.train", "unirl.sync")}
    assert {k: len(v) for k, v in ranges.items()} == dict.fromkeys(ranges, 2)
    t = ranges["unirl.train"][-1].time_range
    inside = {e.name for e in events if t.start <= e.time_range.start and e.time_range.end <= t.end}
    assert any("backward" in name.lower() for name in inside), sorted(inside)[:20]
