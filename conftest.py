"""Repository-wide pytest policy.

In CI (``CI=true``) a skipped test is a failure: a missing dependency must turn CI red, not quietly
shrink what was tested. Tests that are skipped on purpose everywhere do not exist here.
"""

import os
import sys
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"
#: pytest's exit status, kept by ``pytest_sessionfinish`` for ``pytest_unconfigure``
_STATUS: dict[str, int] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in CI (CI=true makes a skip a failure): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A whole module skipped at import (``pytest.importorskip``) is a failure in CI as well."""
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped:
        report.outcome = "failed"


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    _STATUS["exit"] = int(session.exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave with pytest's own exit status once everything is reported, skipping the interpreter's
    finalization (``os._exit``).

    Why: this process has run in-process vLLM engines, gloo process groups, bubblewrap sandboxes and
    trackers with their own atexit hooks. Their native destructors then run in whatever order the
    interpreter tears modules down, and once that order crashed: ``make test`` died with SIGSEGV *after*
    "1565 passed" was printed (ci-local, 2026-12-05), so a green suite read as a red CI. Every test has
    finished and been reported by now; nothing a test checks depends on what finalization would do.
    ``UNIRL_TEST_FINALIZE=1`` keeps the normal exit (to look for the crash)."""
    if "exit" in _STATUS and os.environ.get("UNIRL_TEST_FINALIZE") != "1":
        print(f"conftest: exit {_STATUS['exit']} without interpreter finalization (conftest.py, pytest_unconfigure)",
              file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_STATUS["exit"])


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """The full demo recipe (``recipes/arith-tiny.yaml``) trained once per session on the embedded default.

    Why shared: it is the suite's reference learning run. The core test asserts that it learns, and the
    FSDP test compares its own curve against it. Running it once saves a minute of CI.
    """
    from unirl.config import load_config
    from unirl.kernel import load_kernel
    from unirl.trainer.loop import train

    out = tmp_path_factory.mktemp("demo-run")
    recipe = Path(__file__).resolve().parent / "recipes" / "arith-tiny.yaml"
    # no intermediate evals: their requests are seeded per slot and never batched with training
    # rollouts, so the trajectory and the final eval are the ones the recipe gives with them
    config = load_config(recipe, [f"run.output_dir={out}", "trainer.progress=false", "trainer.plot=false",
                                  "trainer.eval_every=0"])
    return config, train(config, load_kernel())


@pytest.fixture
def no_model(monkeypatch):
    """Building a model fails the test: the bad-input cases must stop before anything expensive. Every
    path that builds one goes through the composition root (:mod:`unirl.trainer.components`): the
    trainer, ``unirl export`` and ``unirl eval``."""
    from unirl.trainer import components, loop

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built for an input that should have been refused first")

    for module, name in ((loop, "build_components"), (components, "build_components"),
                         (components, "build_eval_components"), (components, "build_runtime")):
        monkeypatch.setattr(module, name, refuse)
