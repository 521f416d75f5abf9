"""Preflight's image rules (issue 71, :mod:`unirl.data.image_rules`): each bad vision-language set-up is
one violation naming its field, reported by ``preflight`` before any model is built."""

from __future__ import annotations

import json

import pytest

from unirl.config import RunConfig
from unirl.data.image_rules import image_violations
from unirl.kernel.manager import load_kernel
from unirl.preflight import preflight


@pytest.fixture(scope="module")
def kernel():
    return load_kernel()


def _data(tmp_path, row):
    p = tmp_path / "train.jsonl"
    p.write_text(json.dumps(row) + "\n")
    return str(p)


def _image_violations(config, kernel):
    """The image rules' violations, through the adapter preflight builds (``kernel``'s registry)."""
    adapter = kernel.get("model_adapters", config.model.adapter).load()()
    return sorted((v.field, v.message) for v in image_violations(config, adapter))


def test_image_key_on_a_text_only_model(tmp_path, kernel):
    src = _data(tmp_path, {"prompt": "q", "answer": "1", "image": "a.png"})
    got = _image_violations(RunConfig(data={"source": src, "eval_source": src, "image_key": "image"}), kernel)
    assert [f for f, _ in got] == ["data.image_key"] and "takes text only" in got[0][1]


def test_image_key_naming_no_column(tmp_path, kernel):
    src = _data(tmp_path, {"prompt": "q", "answer": "1", "picture": "a.png"})
    got = _image_violations(RunConfig(model={"adapter": "qwen2_5_vl"},
                                      data={"source": src, "eval_source": src, "image_key": "image"}), kernel)
    assert [f for f, _ in got] == ["data.image_key"] and "names no column" in got[0][1] and "picture" in got[0][1]


def test_image_key_on_the_arith_generator(kernel):
    got = _image_violations(RunConfig(model={"adapter": "qwen2_5_vl"}, data={"image_key": "image"}), kernel)
    assert [f for f, _ in got] == ["data.image_key"] and "arith" in got[0][1]


def test_freeze_vision_on_a_text_only_model(kernel):
    got = _image_violations(RunConfig(actor={"freeze": ["vision"]}), kernel)
    assert [f for f, _ in got] == ["actor.freeze"] and "no vision tower" in got[0][1]


def test_checkpoint_without_its_processor(tmp_path, kernel):
    from unirl.models.qwen2_5_vl import Qwen2_5_VLAdapter

    adapter = Qwen2_5_VLAdapter()
    model_dir = tmp_path / "vl"  # the rule reads the directory's files only (no model is loaded)
    model_dir.mkdir()
    src = _data(tmp_path, {"prompt": "q", "answer": "1", "image": "a.png"})
    config = RunConfig(model={"adapter": "qwen2_5_vl", "path": str(model_dir)},
                       data={"source": src, "eval_source": src, "image_key": "image"})
    got = _image_violations(config, kernel)
    assert [f for f, _ in got] == ["model.path"] and "preprocessor_config.json" in got[0][1]
    adapter.image_processor().save_pretrained(str(model_dir))  # the fix the message names
    assert _image_violations(config, kernel) == []


def test_a_good_vision_config_has_no_image_violation(tmp_path, kernel):
    src = _data(tmp_path, {"prompt": "q", "answer": "1", "image": "a.png"})
    config = RunConfig(model={"adapter": "qwen2_5_vl"}, actor={"freeze": ["vision"]},
                       data={"source": src, "eval_source": src, "image_key": "image"})
    assert _image_violations(config, kernel) == []


def test_preflight_reports_an_image_rule_with_field_and_fix(tmp_path, kernel):
    """The rules run inside ``preflight`` (wired once, in ``plugin_violations``)."""
    src = _data(tmp_path, {"prompt": "q", "answer": "1", "picture": "a.png"})
    config = RunConfig(model={"adapter": "qwen2_5_vl"}, data={"source": src, "eval_source": src, "image_key": "image"})
    got = [v for v in preflight(config, kernel) if v.field == "data.image_key"]
    assert len(got) == 1 and "names no column" in got[0].message and "image column" in got[0].fix
