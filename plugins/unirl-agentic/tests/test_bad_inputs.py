"""Bad ``python_sandbox`` options are preflight violations: named, with the fix, before any model.

Why: the tool is built with the rollout, after the actor's model, so ``user: nosuchuser`` used to end
a run minutes in with a bare ``KeyError`` traceback from ``pwd.getpwnam``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from unirl_agentic.sandbox import PythonSandbox

from unirl.api import ConfigError, RunConfig, load_kernel
from unirl.preflight import preflight

RECIPE = str(Path(__file__).resolve().parents[3] / "recipes" / "agentic-calc-tiny.yaml")
NO_USER = "unirl-no-such-user"
FIELD = "plugins.agentic.tools.python_sandbox"


@pytest.fixture
def no_model(monkeypatch):
    from unirl.trainer import loop

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built for an input preflight should have rejected")

    monkeypatch.setattr(loop, "build_components", refuse)


def _sandbox_config(**options) -> RunConfig:
    return RunConfig(rollout={"environment": "tool_env", "tools": ["python_sandbox"]},
                     plugins={"agentic": {"tools": {"python_sandbox": options}}})


def test_preflight_names_an_account_that_does_not_exist():
    got = {v.field: v for v in preflight(_sandbox_config(user=NO_USER), load_kernel()) if v.source == "unirl-agentic"}
    v = got[f"{FIELD}.user"]
    assert NO_USER in v.message and "no such account" in v.message
    assert "nobody" in v.fix and "leave it unset" in v.fix


def test_preflight_names_an_interpreter_that_is_not_executable(tmp_path):
    got = {v.field: v for v in preflight(_sandbox_config(python=str(tmp_path / "py")), load_kernel())}
    assert str(tmp_path / "py") in got[f"{FIELD}.python"].message and "/usr/bin/python3" in got[f"{FIELD}.python"].fix


def test_existing_account_and_defaults_pass():
    for cfg in (_sandbox_config(), _sandbox_config(user="nobody")):
        assert [v for v in preflight(cfg, load_kernel()) if v.field.startswith(FIELD)] == []


def test_train_exits_2_before_any_model(no_model, tmp_path, capsys):
    from unirl.cli import main

    code = main(["train", RECIPE, f"run.output_dir={tmp_path}", "rollout.tools=[calculator,python_sandbox]",
                 f"{FIELD}.user={NO_USER}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"{FIELD}.user: '{NO_USER}': no such account" in err and "fix: name an existing" in err


def test_the_tool_built_without_preflight_raises_a_config_error():
    """``unirl agentic-demo`` and direct users build the tool without preflight: the same message."""
    with pytest.raises(ConfigError, match=rf"{FIELD}.user: '{NO_USER}': no such account .*fix: "):
        PythonSandbox(options={"user": NO_USER})


def test_agentic_demo_builds_the_tools_before_any_model(monkeypatch, tmp_path, capsys):
    """``unirl agentic-demo`` runs no preflight: it builds the tools first, so the same error comes first."""
    from unirl.api import Kernel
    from unirl.cli import main

    build = Kernel.build

    def guarded(self, kind, name, **kwargs):
        assert kind not in ("actors", "rollout_engines"), f"a model ({kind}) was built before the tools"
        return build(self, kind, name, **kwargs)

    monkeypatch.setattr(Kernel, "build", guarded)
    code = main(["agentic-demo", RECIPE, f"run.output_dir={tmp_path}", "rollout.tools=[calculator,python_sandbox]",
                 f"{FIELD}.user={NO_USER}"])
    err = capsys.readouterr().err
    assert code == 2 and f"{FIELD}.user: '{NO_USER}': no such account" in err and "Traceback" not in err
