"""``ModelAdapter.build_empty``: the seam a sharded actor builds on (``unirl_fsdp.loading``).

The meta-device tree must be exactly what ``build_model`` returns, in class, parameter and buffer names,
shapes and fp32 dtype, with no memory behind it; an adapter that does not offer one says None."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from unirl.config import RunConfig  # noqa: E402
from unirl.contracts import ModelAdapter  # noqa: E402
from unirl.models.qwen3 import Qwen3Adapter  # noqa: E402
from unirl.models.qwen3_moe import Qwen3MoeAdapter  # noqa: E402

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}


def _same_tree(empty: torch.nn.Module, full: torch.nn.Module) -> None:
    assert type(empty) is type(full)
    for kind in ("named_parameters", "named_buffers"):
        e, f = dict(getattr(empty, kind)()), dict(getattr(full, kind)())
        assert e.keys() == f.keys(), kind
        for name, t in e.items():
            assert t.is_meta and t.shape == f[name].shape and t.dtype == torch.float32, name
    assert empty.config.use_cache is False


@pytest.mark.parametrize("adapter", [Qwen3Adapter(), Qwen3MoeAdapter()], ids=["qwen3", "qwen3_moe"])
def test_build_empty_is_build_models_tree_on_meta(adapter, tmp_path):
    build = RunConfig.model_validate({"model": {"adapter": adapter.name, "build": SMALL, "dtype": "bfloat16"}})
    full = adapter.build_model(build).float()
    _same_tree(adapter.build_empty(build), full)
    full.save_pretrained(str(tmp_path))  # and from a directory: the class its config.json names
    loaded = RunConfig.model_validate({"model": {"adapter": adapter.name, "path": str(tmp_path)}})
    _same_tree(adapter.build_empty(loaded), adapter.build_model(loaded).float())


def test_moe_build_empty_refuses_a_dense_checkpoint(tmp_path):
    dense = RunConfig.model_validate({"model": {"build": SMALL}})
    Qwen3Adapter().build_model(dense).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="model.adapter=qwen3_moe needs a Qwen3-MoE checkpoint"):
        Qwen3MoeAdapter().build_empty(RunConfig.model_validate({"model": {"adapter": "qwen3_moe",
                                                                          "path": str(tmp_path)}}))


def test_default_adapter_has_no_empty_build():
    class Plain(ModelAdapter):
        def build_model(self, config, tokenizer=None):
            raise AssertionError("not called")

        def build_tokenizer(self, config):
            return None

        def hf_config(self, config):
            return None

    assert Plain().build_empty(RunConfig()) is None
