"""The trainer's rollout drivers: one launch-window formula, one publish path, and a loop that only
orders components. The end-to-end numbers of each mode are the recipes' own tests; here, what the
refactor into drivers promised."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from unirl.config import load_config
from unirl.kernel import load_kernel
from unirl.kernel.hookspecs import hookimpl
from unirl.rollout.controller import launch_ceiling, version_at
from unirl.trainer.loop import train

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "core" / "src" / "unirl"
SMALL = [
    "sft.steps=10", "sft.batch_size=16", "trainer.steps=4", "trainer.prompts_per_step=4", "trainer.eval_every=2",
    "trainer.progress=false", "trainer.plot=false", "data.arith.n_train=64", "data.arith.n_eval=4",
    "rollout.n=4", "rollout.max_new_tokens=4", "trainer.eval_k=2",
]


# ------------------------------------------------------------------------------ the launch window


@pytest.mark.parametrize("interval,staleness", list(itertools.product((1, 2, 3), (0, 1, 2))))
def test_launch_ceiling_is_the_staleness_bound_solved_for_the_step(interval, staleness):
    """Below the ceiling every launch trains at most ``staleness`` versions after the one now served;
    the ceiling itself would be one version too old. Checked for many ledger positions and origins."""
    for first, base, ahead in itertools.product((0, 3, 7), (0, 1, 5), range(4)):
        version = base + ahead
        ceil = launch_ceiling(version, first_gen=first, base_version=base, interval=interval, max_staleness=staleness)
        ahead_of = [version_at(g, first_gen=first, base_version=base, interval=interval) - version
                    for g in range(first, ceil + 1)]
        assert all(a <= staleness for a in ahead_of[:-1]) and ahead_of[-1] == staleness + 1


def test_staleness_zero_launches_nothing_into_a_future_sync_window():
    """On-policy async (max_staleness 0): before the first update only the current window's steps may
    launch, and every one of them trains under the version it was sampled with (ratio 1)."""
    for interval in (1, 2, 4):
        ceil = launch_ceiling(0, first_gen=0, base_version=0, interval=interval, max_staleness=0)
        assert ceil == interval
        assert {version_at(g, first_gen=0, base_version=0, interval=interval) for g in range(ceil)} == {0}


# ------------------------------------------------------------------------------ one publish path


class Published:
    @hookimpl
    def unirl_on_weights_published(self, version, receipts, config):
        self.versions.append(version)
        assert receipts and all(r.version == version for r in receipts)

    def __init__(self):
        self.versions: list[int] = []


@pytest.mark.parametrize("mode", [
    [],
    ["rollout.mode=async", "rollout.max_staleness=1", "rollout.weight_sync_interval=2"],
])
def test_each_publish_fires_the_hook_once_and_writes_one_log_line(tmp_path, mode):
    spy = Published()
    config = load_config(ROOT / "recipes" / "arith-tiny.yaml",
                         [*SMALL, f"run.output_dir={tmp_path}", "run.name=r", *mode])
    result = train(config, load_kernel(extra=[("published", spy)]))
    final = result.history[-1]["version"]
    # the initial publish (version 1), then one per sync: every version exactly once, in order
    assert spy.versions == list(range(1, final + 1))
    assert final == (1 + 4 if not mode else 1 + 2)  # sync: every step; async: every weight_sync_interval steps
    lines = (config.run_dir / "weights.log").read_text().splitlines()
    assert [int(line.split("version ")[1].split(":")[0]) for line in lines] == spy.versions
    assert all("receipt(s)" in line and "fingerprint" in line and "publish" in line for line in lines)
    evals = [h for h in result.history if "eval" in h]
    assert [h["step"] for h in evals] == [0, 2, 4]
    # each eval names the version it measured: the one served after the step before it
    assert evals[0]["eval/weight_version"] == 1 and evals[-1]["eval/weight_version"] == final


# ------------------------------------------------------------------------------ the loop's shape


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def test_the_loop_reads_in_one_sitting():
    """trainer/loop.py <= 350 lines, _train <= 40, no function in trainer/ over 60 lines."""
    loop = SRC / "trainer" / "loop.py"
    assert len(loop.read_text().splitlines()) <= 350
    train_fn = next(f for f in _functions(loop) if f.name == "_train")
    assert train_fn.end_lineno - train_fn.lineno + 1 <= 40
    long = [(p.name, f.name, f.end_lineno - f.lineno + 1) for p in (SRC / "trainer").glob("*.py")
            for f in _functions(p) if f.end_lineno - f.lineno + 1 > 60]
    assert not long, long


def test_trainer_never_asks_what_kind_of_controller_or_driver_it_has():
    offenders = []
    for p in (SRC / "trainer").glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                names = ast.unparse(node.args[1])
                if "Controller" in names or "Driver" in names:
                    offenders.append(f"{p.name}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, offenders


def test_weights_published_is_fired_from_exactly_one_place_in_core():
    calls = [f"{p.relative_to(SRC)}:{node.lineno}" for p in SRC.rglob("*.py")
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and a.value == "unirl_on_weights_published"
                                                   for a in node.args)]
    assert calls == ["trainer/drivers.py:" + calls[0].split(":")[1]], calls
