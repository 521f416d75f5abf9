"""Dataset sources beyond JSON Lines / Parquet: ``.json`` and ``.csv`` files, a ``save_to_disk``
directory (a Dataset or a DatasetDict's split), a dataset name read from the local HF cache with no
network, and verl's key names (``data.train``, ``data.prompt_key`` ...). Each source is read by the real
HF ``datasets``; the cached-name test checks the fixture against ``load_dataset`` under
``HF_DATASETS_OFFLINE=1`` in a fresh process (datasets' own offline reader, an independent oracle)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import datasets
import pytest

from unirl.config import load_config
from unirl.data.datasets import data_violations, load_prompts
from unirl.kernel.errors import DataError
from unirl.models.tokenizer import build_demo_tokenizer

TOK = build_demo_tokenizer()
ROWS = [{"question": f"{i}+1=?", "solution": str(i + 1), "extra": i} for i in range(6)]
HELD = [{"question": f"{i}*2=?", "solution": str(2 * i), "extra": i} for i in range(3)]
KEYS = ["data.prompt_key=question", "data.answer_key=solution", "trainer.prompts_per_step=2"]


def config(train, evals=None, *extra):
    args = [f"data.train={train}", *KEYS, *extra]
    if evals is not None:
        args.append(f"data.eval={evals}")
    return load_config(None, args)


def loaded(cfg, split="train"):
    samples, stats = load_prompts(cfg, TOK, split)
    return [s.prompt_text for s in samples], [s.answer for s in samples], stats


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test: the sources are read with no network."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")
    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_json_array_and_csv_files_with_verl_key_names(tmp_path, no_network):
    (tmp_path / "train.json").write_text(json.dumps(ROWS))
    with open(tmp_path / "eval.csv", "w") as f:
        f.write("question,solution,extra\n" + "".join(f"{r['question']},{r['solution']},{r['extra']}\n" for r in HELD))
    cfg = config(tmp_path / "train.json", tmp_path / "eval.csv")
    assert cfg.data.source == str(tmp_path / "train.json") and cfg.data.prompt_field == "question"
    prompts, answers, stats = loaded(cfg)
    assert prompts == [r["question"] for r in ROWS] and answers == [r["solution"] for r in ROWS]
    prompts, answers, _ = loaded(cfg, "eval")
    assert prompts == [r["question"] for r in HELD]
    assert [str(a) for a in answers] == [r["solution"] for r in HELD]  # csv infers integers
    assert data_violations(cfg) == []


def test_save_to_disk_dataset_and_datasetdict_splits(tmp_path, no_network):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "plain"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "validation": datasets.Dataset.from_list(HELD)}).save_to_disk(str(tmp_path / "dd"))
    prompts, _, _ = loaded(config(tmp_path / "plain"))
    assert prompts == [r["question"] for r in ROWS]
    cfg = config(tmp_path / "dd", tmp_path / "dd", "data.eval_split=validation")
    assert loaded(cfg)[0] == [r["question"] for r in ROWS]
    assert loaded(cfg, "eval")[0] == [r["question"] for r in HELD]
    with pytest.raises(DataError, match=r"data.eval_source: .*dd has no split 'test'; its splits: train, "
                                        r"validation \(fix: set data.eval_split"):
        loaded(config(tmp_path / "dd", tmp_path / "dd"), "eval")


def make_cached(cache, name, splits):
    """Write ``name`` into the HF datasets cache in the layout a Hub download leaves
    (``<owner>___<name>/<config>/<version>/<hash>/``), built by datasets' own Parquet builder."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    src = cache.parent / "src"
    src.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        datasets.Dataset.from_list(rows).to_parquet(str(src / f"{split}.parquet"))
        files[split] = str(src / f"{split}.parquet")
    owner, short = name.split("/")
    builder = Parquet(cache_dir=str(cache), dataset_name=short, data_files=files, hash="0123abcd",
                      config_name="default")
    builder.download_and_prepare()
    built = next((cache / short).iterdir())  # default-<hash of the data files>
    (cache / f"{owner}___{short}").mkdir()
    built.rename(cache / f"{owner}___{short}" / "default")


def test_dataset_name_from_the_local_hf_cache_without_network(tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    make_cached(cache, "unirl-test/toy_math", {"train": ROWS, "test": HELD})
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    oracle = subprocess.run(
        [sys.executable, "-c", "import datasets, json; print(json.dumps(list(datasets.load_dataset("
         "'unirl-test/toy_math', split='test')['question'])))"],
        env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
        timeout=120)
    assert oracle.returncode == 0, oracle.stderr[-2000:]
    assert json.loads(oracle.stdout.strip().splitlines()[-1]) == [r["question"] for r in HELD]

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    cfg = config("unirl-test/toy_math", "unirl-test/toy_math")
    assert loaded(cfg)[0] == [r["question"] for r in ROWS]
    assert loaded(cfg, "eval")[0] == [r["question"] for r in HELD]  # eval_split defaults to test
    assert data_violations(cfg) == []
    with pytest.raises(DataError) as err:
        loaded(config("unirl-test/not_cached"))
    text = str(err.value)
    assert "'unirl-test/not_cached' is not a file or directory, and not a dataset in the local HF cache" in text
    assert str(cache) in text and "runs never download" in text


def test_a_bad_column_name_lists_the_columns_found(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "plain"))
    with pytest.raises(DataError) as err:
        loaded(load_config(None, [f"data.train={tmp_path / 'plain'}", "data.prompt_key=prompt",
                                  "data.answer_key=solution"]))
    text = str(err.value)
    assert "data.prompt_field = 'prompt'" in text and "available columns: question, solution, extra" in text


def test_empty_sources(tmp_path):
    datasets.Dataset.from_dict({"question": [], "solution": []}).save_to_disk(str(tmp_path / "empty"))
    (tmp_path / "empty.csv").write_text("question,solution\n")
    for source in (tmp_path / "empty", tmp_path / "empty.csv"):
        with pytest.raises(DataError, match=r"has no rows"):
            loaded(config(source))


def test_preflight_names_the_first_bad_rows_of_a_directory_source(tmp_path):
    rows = [dict(r) for r in ROWS]
    rows[1]["question"] = None
    rows[4]["question"] = "   "
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "bad"))
    (found,) = data_violations(config(tmp_path / "bad", tmp_path / "bad"))[:1]
    assert found.field == "data.source"
    assert "row 2: field 'question' is missing or null" in found.message
    assert "row 5: field 'question' is an empty string" in found.message


def test_a_key_and_its_alias_together_are_refused():
    from unirl.kernel.errors import ConfigError

    with pytest.raises(ConfigError, match="data.prompt_key and data.prompt_field are the same setting"):
        load_config(None, ["data.prompt_key=q", "data.prompt_field=p"])
