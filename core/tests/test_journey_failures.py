"""No silent failures, and no run-directory litter, as a user meets them through the CLI entry.

* A reward that fails on every sample stops the run after ``trainer.max_failed_steps`` steps with exit
  2, a message naming the key, the reward and one error; the failed fraction is in metrics.jsonl, on
  the progress bar text and in the plot.
* A run that fails before its first training step leaves a directory marked NOT_STARTED, which the
  next run replaces; a run that trained is kept (renamed), and the message offers resume only when
  there is a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unirl import cli
from unirl.config import load_config
from unirl.kernel import manager
from unirl.kernel.hookspecs import hookimpl
from unirl.trainer.failures import FailureGuard
from unirl.trainer.report import curves_figure, step_status
from unirl.trainer.run_dir import NOT_STARTED, prepare_run_dir

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "arith-tiny.yaml")
TINY = [
    "sft.steps=0", "trainer.steps=6", "trainer.prompts_per_step=2", "trainer.eval_every=0", "trainer.eval_k=1",
    "trainer.progress=false", "trainer.plot=false", "trainer.export_hf=false", "data.arith.n_train=16",
    "data.arith.n_eval=2", "rollout.n=2", "rollout.max_new_tokens=3",
    "model.build={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1}",
]


class Plugin:
    """In-process test plugin: a reward that always raises, and a publish hook that can fail."""

    fail_publish = False

    @staticmethod
    def broken(completion, sample):
        raise ValueError(f"cannot parse gold answer {sample.answer!r}")

    @hookimpl
    def unirl_rewards(self):
        return {"broken": Plugin.broken}

    @hookimpl
    def unirl_on_weights_published(self, version):
        if Plugin.fail_publish:
            raise RuntimeError("engine died while loading weights")


@pytest.fixture
def kernel_with_plugin(monkeypatch):
    real = manager.load_kernel

    def load(**kw):
        kernel = real(**kw)
        kernel.register(Plugin(), entry_point="journey", dist="test-journey", version="0")
        return kernel

    monkeypatch.setattr(manager, "load_kernel", load)
    Plugin.fail_publish = False
    yield
    Plugin.fail_publish = False


def test_all_failed_rewards_stop_the_run_naming_the_key_and_an_error(tmp_path, kernel_with_plugin, capsys):
    code = cli.main(["train", RECIPE, *TINY, f"run.output_dir={tmp_path}", "run.name=r", "reward.name=broken",
                     "trainer.plot=true"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "stopped after step 3" in err and "trainer.max_failed_frac=0.5" in err, err
    assert "Reward 'broken'" in err and "ValueError: cannot parse gold answer" in err, err
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["failed_frac"] for r in rows if r["step"] > 0] == [1.0, 1.0, 1.0]
    assert (tmp_path / "r" / "curves.png").is_file(), "the curves up to the stop are drawn"


def test_failed_fraction_on_the_bar_and_the_plot():
    assert step_status({"reward": 0.0, "failed_frac": 1.0}) == "reward 0.000 [red]failed 100%[/]"
    assert step_status({"reward": 0.5, "failed_frac": 0.0, "eval": 0.25}) == "reward 0.500 eval 0.250"
    history = [{"step": 0, "eval": 0.1}, {"step": 1, "reward": 0.0, "failed_frac": 1.0},
               {"step": 2, "reward": 0.0, "failed_frac": 0.5}]
    fig = curves_figure(history)
    try:
        lines = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_label() == "failed fraction"]
        assert len(lines) == 1 and list(lines[0].get_ydata()) == [1.0, 0.5]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_failure_guard_needs_consecutive_steps_above_the_threshold():
    config = load_config(None, ["trainer.max_failed_frac=0.5", "trainer.max_failed_steps=3"])
    guard = FailureGuard(config)
    verdicts = [guard.check(i + 1, f, "e") for i, f in enumerate([0.9, 0.9, 0.5, 0.9, 0.9, 0.9])]
    assert [v is not None for v in verdicts] == [False, False, False, False, False, True]  # 0.5 is not above
    never = FailureGuard(load_config(None, ["trainer.max_failed_frac=1"]))
    assert all(never.check(i, 1.0, "e") is None for i in range(10))


def test_a_run_that_failed_before_training_is_replaced_by_the_next(tmp_path, kernel_with_plugin, capsys):
    Plugin.fail_publish = True  # the first publish happens before any training step
    with pytest.raises(RuntimeError, match="engine died"):
        cli.main(["train", RECIPE, *TINY, f"run.output_dir={tmp_path}", "run.name=r"])
    run = tmp_path / "r"
    assert (run / NOT_STARTED).is_file()
    said: list[str] = []
    config = load_config(RECIPE, [*TINY, f"run.output_dir={tmp_path}", "run.name=r"])
    prepare_run_dir(config, said.append)
    assert said == [f"replaced {run}, left by a run that never started training"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"], "replaced, not renamed aside"


def test_a_run_that_trained_is_kept_and_resume_offered_only_with_a_checkpoint(tmp_path):
    config = load_config(RECIPE, [*TINY, f"run.output_dir={tmp_path}", "run.name=r"])
    run = config.run_dir
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # trained a step, never checkpointed
    said: list[str] = []
    prepare_run_dir(config, said.append)
    assert len(said) == 1 and said[0].startswith("kept the previous run in") and "no checkpoint" in said[0]
    assert (run / NOT_STARTED).is_file()  # the new run is not started yet
    (run / NOT_STARTED).unlink()
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "checkpoints" / "step_000001" / "meta.json").write_text("{}")
    said.clear()
    prepare_run_dir(config, said.append)
    assert "set run.resume=true to continue it instead" in said[0]
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("r.")]) == 2



def test_an_eval_whose_rewards_all_failed_reads_nan_and_says_why(capsys):
    """Issue 17's silent failure in eval: every reward failing must not print as a model scoring 0."""
    import math

    from unirl.config import load_config
    from unirl.samples import Sample
    from unirl.trainer.loop import eval_score

    config = load_config(RECIPE, ["trainer.progress=true"])
    slots = [Sample(id=f"p{i}/0", prompt_ids=[1]) for i in range(4)]
    for s in slots:
        s.reward = math.nan
        s.meta["error"] = "ValueError: cannot parse gold answer 'x'"
    assert math.isnan(eval_score(slots, config, step=0))
    out = capsys.readouterr().out
    assert "4 of 4 samples failed" in out and "cannot parse gold answer" in out, out
    slots[0].reward, slots[1].reward = 1.0, 0.0  # two scored: their mean; the two failed are not misses
    assert eval_score(slots, config, step=5) == 0.5
    assert "2 of 4 samples failed" in capsys.readouterr().out
