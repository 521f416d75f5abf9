"""The parity contract reads what the engine and actor declare (issue 72): a rule fires on the declared
layout, at the field the component names, whatever the component is called; nothing in the plugin
imports another engine plugin or compares component names."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from unirl.api import Qwen3Adapter, declared_capabilities, load_config, load_kernel
from unirl_parity_vllm import plugin, rules

ROOT = Path(__file__).resolve().parents[3]
SRC = Path(plugin.__file__).parent


@pytest.fixture
def flag_on(monkeypatch):
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "1")
    monkeypatch.delenv("UNIRL_PARITY_DIR", raising=False)


def _check(config, caps):
    return [(v.field, v.message) for v in plugin.unirl_preflight(config, Qwen3Adapter(), load_kernel(), caps)]


def test_rules_fire_on_the_declared_layout_at_the_declared_field(flag_on):
    config = load_config(str(ROOT / "recipes" / "parity-tiny-embedded.yaml"), [])
    caps = declared_capabilities(config)
    assert _check(config, caps) == []
    engine = dataclasses.replace(caps.engine, tensor_parallel=3, eager=False,
                                 fields=(("tensor_parallel", "rollout.options.tp"), ("eager", "rollout.options.eager")))
    got = _check(config, dataclasses.replace(caps, engine=engine))
    assert [f for f, _ in got] == ["rollout.options.tp", "rollout.options.eager"], got
    assert "tensor_parallel_size 3" in got[0][1] and "eager=False" in got[1][1]
    actor = dataclasses.replace(caps.actor, ranks=4, compiled=True)
    got = _check(config, dataclasses.replace(caps, actor=actor))
    # the recipe's profile pins actor_ranks 1: the declared ranks are what the run has
    assert got == [("plugins.parity.topology.actor_ranks", "profile says 1, the run has 4"),
                   ("actor.options.compile", got[1][1])] and "torch.compile" in got[1][1]


def test_the_rules_are_a_table():
    assert all(isinstance(r, rules.Rule) for r in rules.RULES + rules.MODEL_RULES + rules.LAYOUT_RULES)
    assert len(rules.LAYOUT_RULES) >= 10


def test_no_engine_plugin_import_and_no_name_comparison():
    text = "\n".join(p.read_text() for p in SRC.rglob("*.py"))
    assert "unirl_vllm" not in re.sub(r"#.*", "", text)
    assert not re.search(r"(rollout\.engine|actor\.name)\s*[!=]=", text)


def test_the_artifact_freezes_the_declared_layout(flag_on, tmp_path):
    """The artifact's TP and profile come from the declarations: the ones preflight was handed when it
    ran for this config, else resolved from the installed plugins."""
    from unirl_parity_vllm.artifact import Recorder

    config = load_config(str(ROOT / "recipes" / "parity-tiny-tp2.yaml"), [f"run.output_dir={tmp_path}"])
    doc = Recorder(config).document()
    assert doc["run"]["tensor_parallel_size"] == 2 and doc["profile"]["topology"]["engine_workers"] == 2
    caps = declared_capabilities(config)
    _check(config, dataclasses.replace(caps, engine=dataclasses.replace(caps.engine, workers=6)))
    assert Recorder(config).document()["profile"]["topology"]["engine_workers"] == 6  # what preflight saw
