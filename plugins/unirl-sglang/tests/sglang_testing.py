"""Helpers for the plugin's tests: engines pointed at stand-in servers, and the replay oracle.

A module with a unique name (not ``conftest``): every plugin has a conftest, and a plain
``import conftest`` could find another plugin's."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def engine_config(model_dir: Path, run_dir: Path, urls: list[str], **options: Any):
    from unirl.api import RunConfig

    opts = {"servers": urls, "retries": 2, "backoff_s": 0.05, "health_timeout_s": 10, **options}
    return RunConfig.model_validate({"run": {"output_dir": str(run_dir), "name": "sg"},
                                     "model": {"path": str(model_dir)},
                                     "rollout": {"engine": "sglang", "options": opts},
                                     "weight_sync": {"name": "sglang"}})


def make_engine(model_dir: Path, run_dir: Path, urls: list[str], **options: Any):
    from unirl.api import Qwen3Adapter, build_engine

    config = engine_config(model_dir, run_dir, urls, **options)
    adapter = Qwen3Adapter()
    return build_engine(config, adapter=adapter, tokenizer=adapter.build_tokenizer(config))


def replay(model_dir_or_model: Any, sample: Any) -> list[float]:
    """Teacher-forced fp32 log-probs of ``sample``'s response under a transformers forward (the oracle)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = model_dir_or_model
    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    p = len(sample.prompt_ids)
    lp = torch.log_softmax(logits[p - 1 : -1], -1).gather(-1, ids[0, p:, None])[:, 0]
    return lp.tolist()


def actor_replay(model_dir: Path, run_dir: Path, samples: list[Any]) -> list[list[float]]:
    """The embedded actor's own replay (``Actor.logprobs``) of ``samples``, from ``model_dir``'s weights."""
    from unirl.api import RunConfig, build_runtime, load_kernel

    config = RunConfig.model_validate({"run": {"output_dir": str(run_dir), "name": "replay"},
                                       "model": {"path": str(model_dir)}})
    kernel = load_kernel()
    adapter = kernel.build("model_adapters", config.model.adapter)
    tokenizer = adapter.build_tokenizer(config)
    actor = kernel.build("actors", "torch", config=config, adapter=adapter, tokenizer=tokenizer,
                         runtime=build_runtime(config, kernel, adapter=adapter))
    try:
        return [t.tolist() for t in actor.logprobs(samples)]
    finally:
        actor.close()
