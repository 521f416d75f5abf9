"""The public API of unirl-core: the one module a plugin imports from.

Why one module: a plugin that reaches into ``unirl.actor.skeleton`` or ``unirl.engine.queued`` breaks
whenever core reorganises its internals. Everything a plugin may rely on is named here, and only here;
``core/tests/test_public_api.py`` fails if a plugin's ``src/`` imports any other ``unirl`` module.
Changing a name in this table is a contract change and is called out in the changelog.

Names resolve lazily (PEP 562), so ``from unirl.api import hookimpl`` stays cheap: torch is imported
only when a name that needs it (an actor skeleton, the queued engine) is first used.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> the module that owns it
_EXPORTS: dict[str, str] = {
    # kernel: hooks, errors, discovery
    "hookimpl": "unirl.kernel.hookspecs",
    "Kernel": "unirl.kernel.manager",
    "KernelHooks": "unirl.kernel.manager",
    "load_kernel": "unirl.kernel.manager",
    "UniRLError": "unirl.kernel.errors",
    "Violation": "unirl.kernel.errors",
    "ConfigError": "unirl.kernel.errors",
    "PluginError": "unirl.kernel.errors",
    "PreflightError": "unirl.kernel.errors",
    "DataError": "unirl.kernel.errors",
    "SampleError": "unirl.kernel.errors",
    "WeightSyncError": "unirl.kernel.errors",
    "SyncRefusedError": "unirl.kernel.errors",
    "WorkerLostError": "unirl.kernel.errors",
    "EngineStalledError": "unirl.rollout.stall",  # a hung engine (rollout.stall_timeout_s): restartable
    # config and the per-run runtime
    "RunConfig": "unirl.config",
    "BranchingSection": "unirl.config",
    "load_config": "unirl.config",
    # the base of every options model: unknown keys and NaN / +-inf refused at config time
    "StrictOptions": "unirl.config_bounds",
    "Runtime": "unirl.runtime",
    "default_runtime": "unirl.testing",  # for tests: a component built by hand needs a runtime
    "build_engine": "unirl.testing",  # for tests: rollout.engine built as a run builds it
    "build_actor": "unirl.testing",  # for tests: actor.name built as a run builds it
    "count_prefill": "unirl.testing",  # for tests: the context tokens the embedded decoder prefilled
    "OptionsError": "unirl.kernel.errors",
    "build_runtime": "unirl.runtime",
    # contracts (the ABCs and the hot dataclasses)
    "Actor": "unirl.contracts",
    "BeforeBackward": "unirl.contracts",
    "BackwardContext": "unirl.contracts",
    "BatchReward": "unirl.contracts",
    "EngineCapabilities": "unirl.contracts",
    "plugin_section": "unirl.plugin_sections",
    "section_options": "unirl.plugin_sections",
    "declared_capabilities": "unirl.declared",
    "ActorCapabilities": "unirl.contracts",
    "ControllerCapabilities": "unirl.contracts",
    "Capabilities": "unirl.contracts",
    "dtype_name": "unirl.contracts",
    "Environment": "unirl.contracts",
    "RolloutController": "unirl.contracts",
    "EnvStep": "unirl.contracts",
    "EstimatorTraits": "unirl.contracts",
    "Handle": "unirl.contracts",
    "ModelAdapter": "unirl.contracts",
    "ParityProvider": "unirl.contracts",
    # the sampled tokens' log-prob distribution (rollout.logprobs): raw, or processed in vLLM's order
    "LogprobProcessing": "unirl.logprobs",
    "apply_top_k_top_p": "unirl.logprobs",
    "process_logits": "unirl.logprobs",
    "selected_logprobs": "unirl.logprobs",
    "Receipt": "unirl.contracts",
    "RolloutEngine": "unirl.contracts",
    "EngineProgress": "unirl.contracts.engine",  # what RolloutEngine.progress() reports (the stall timeout reads it)
    "SamplingParams": "unirl.contracts",
    "stop_token_ids": "unirl.contracts",
    "StepInfo": "unirl.contracts",
    "Tool": "unirl.contracts",
    "ToolResult": "unirl.contracts",
    "TraceExporter": "unirl.contracts",
    "Tracker": "unirl.contracts",
    "VersionLedger": "unirl.contracts",
    "WeightSync": "unirl.contracts",
    "fingerprint": "unirl.contracts",
    "adapter_fingerprint": "unirl.contracts",
    "ADAPTER_WEIGHTS": "unirl.contracts",
    "verify_receipts": "unirl.contracts",
    # samples
    "Sample": "unirl.samples",
    "attach_routes": "unirl.routing",  # R3: an engine's expert-id records onto the sample (Sample.routing)
    # its content: Parts with roles, grouped into Turns; fork branches extend the parent's path id
    "Part": "unirl.samples",
    "sample_row": "unirl.sample_rows",  # a Sample as one JSON object (its Parts, fork path), and back
    "sample_from_row": "unirl.sample_rows",
    "Turn": "unirl.samples",
    "Span": "unirl.samples",
    "MODEL_ROLES": "unirl.samples",
    "fork_id": "unirl.samples",
    "fork_point": "unirl.samples",
    "expand": "unirl.samples",
    "load_prompts": "unirl.data.datasets",
    # chat templates (data.chat_template): the ids of a later turn, the template's end-of-turn token
    "chat_turn_ids": "unirl.data.chat",
    "end_of_turn_id": "unirl.data.chat",
    "response_end_id": "unirl.data.chat",
    "split": "unirl.samples",
    "now_ms": "unirl.samples",
    "eval_seed": "unirl.samples",
    # weights (staging and validation of a weight payload)
    "WeightSpec": "unirl.weights",
    "Staged": "unirl.weights",
    "Fingerprint": "unirl.weights",
    "stage_all": "unirl.weights",
    "TIED_HEAD": "unirl.weights",
    # building blocks for engines, actors and syncs
    "QueuedEngine": "unirl.engine.queued",
    "InProcessSync": "unirl.sync.inprocess",
    "choose_transport": "unirl.sync.transport",
    # placement of Ray processes (actor ranks, engine replicas)
    "Placement": "unirl.placement",
    "Location": "unirl.placement",
    "here": "unirl.placement",
    "describe_node": "unirl.placement",
    "connect_ray": "unirl.placement",
    "ActorSkeleton": "unirl.actor.skeleton",
    "freeze_parts": "unirl.actor.freeze",
    "install_actor_hooks": "unirl.actor.vision_inputs",
    "ActorInputError": "unirl.actor.skeleton",
    "MicroBatch": "unirl.actor.skeleton",
    "micro_batch_bounds": "unirl.actor.skeleton",
    "check_samples": "unirl.actor.skeleton",
    "step_denominators": "unirl.actor.skeleton",
    "step_metrics": "unirl.actor.skeleton",
    "hf_named_weights": "unirl.actor.skeleton",
    "write_hf_dir": "unirl.actor.skeleton",
    # user-named output paths (reports, exports): what may be replaced
    "OutputExistsError": "unirl.outputs",
    "claim_output_dir": "unirl.outputs",
    "claim_output_file": "unirl.outputs",
    "mark_output_dir": "unirl.outputs",
    "replace_output_dir": "unirl.outputs",
    "record_output_file": "unirl.outputs",
    "file_is_ours": "unirl.outputs",
    # what engine plugins share: the start-up directory and the sync's buckets
    "engine_init_dir": "unirl.engine.init_dir",
    "weight_buckets": "unirl.weights",
    # the one atomic file write and directory swap (unirl.fsio), and the one ValidationError converter
    "atomic_write": "unirl.fsio",
    "atomic_write_json": "unirl.fsio",
    "atomic_write_with": "unirl.fsio",
    "swap_dir": "unirl.fsio",
    # a write the run needs (checkpoint, metrics, export, a plugin's artifact) that fails: one message
    # naming the path, the bytes and the fix, and run.on_save_error (fail | warn)
    "RunWriteError": "unirl.trainer.write_errors",
    "guarded_write": "unirl.trainer.write_errors",
    "violations_from": "unirl.kernel.errors",
    # checkpoints an actor writes itself (the FSDP actor): the one atomic protocol, by name
    "CheckpointError": "unirl.actor.checkpoint",
    "CHECKPOINT_EXTRA_FILE": "unirl.actor.checkpoint",
    "CHECKPOINT_META_FILE": "unirl.actor.checkpoint",
    "atomic_replace_dir": "unirl.actor.checkpoint",
    "staging_dir": "unirl.actor.checkpoint",
    "staging_tmp": "unirl.actor.checkpoint",
    "clean_stale": "unirl.actor.checkpoint",
    "fsync_file": "unirl.fsio",
    "write_meta": "unirl.actor.checkpoint",
    "write_pointer": "unirl.actor.checkpoint",
    "resolve_checkpoint": "unirl.actor.checkpoint",
    "rng_state": "unirl.actor.checkpoint",
    "set_rng_state": "unirl.actor.checkpoint",
    "checkpoint_phase": "unirl.actor.checkpoint",
    "check_checkpoint_kind": "unirl.actor.checkpoint",
    "check_adapter_shapes": "unirl.actor.checkpoint",
    # LoRA through peft (actor.lora): what a distributed actor applies, merges and checks on every rank
    "LoraError": "unirl.actor.lora",
    "apply_lora": "unirl.actor.lora",
    "merged_named_weights": "unirl.actor.lora",
    "base_fingerprint": "unirl.actor.lora",
    "check_base": "unirl.actor.lora",
    "write_adapter_dir": "unirl.actor.lora",
    # algorithms: what an estimator or a loss hook returns and receives
    "estimator": "unirl.algorithms.advantages",
    "group_layers": "unirl.algorithms.advantages",
    "AdvantageResult": "unirl.algorithms.advantages",
    "LossInputs": "unirl.algorithms.losses",
    "LossSettings": "unirl.algorithms.losses",
    "groups": "unirl.samples",
    # rewards and training, for a plugin's own tests and commands
    "score": "unirl.rewards.builtin",
    "train": "unirl.trainer.loop",
    # per-phase memory: a process's peak since last asked (an FSDP rank answers Actor.memory_peaks with it)
    "MemoryPeak": "unirl.memory",
    "process_meter": "unirl.memory",
    # the memory plan: what an actor or engine declares it holds per device (Actor/RolloutEngine.memory_layout)
    "MemoryLayout": "unirl.memory_plan.layout",
    "DeviceLoad": "unirl.memory_plan.layout",
    "MemoryItem": "unirl.memory_plan.layout",
    "MemoryFix": "unirl.memory_plan.layout",
    "ModelFacts": "unirl.memory_plan.layout",
    "RankShape": "unirl.memory_plan.arithmetic",
    "actor_items": "unirl.memory_plan.arithmetic",
    "DTYPE_BYTES": "unirl.memory_plan.layout",
    # run.allocator: a process that trains (an FSDP rank too) applies it (retain keeps the memory it frees)
    "apply_allocator": "unirl.allocator",
    "give_back_freed_memory": "unirl.allocator",
    "trim_after_transient": "unirl.allocator",
    # a plugin command's long work (generating data) shows the run's bar, off with trainer.progress
    "progress_bar": "unirl.trainer.report",
    # models
    "Qwen3Adapter": "unirl.models.qwen3",
    "build_demo_tokenizer": "unirl.models.tokenizer",
    "build_chat_demo_tokenizer": "unirl.models.tokenizer",
    "build_word_demo_tokenizer": "unirl.models.tokenizer",
    "load_tokenizer": "unirl.models.tokenizer",
    # images on prompts (issue 71): a server engine passes a sample's prompt images with its request
    "PromptImages": "unirl.multimodal",
    "images_of": "unirl.multimodal",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"unirl.api has no public name {name!r}; the public names are unirl.api.__all__")
    mod = importlib.import_module(module)
    value = mod if module.rsplit(".", 1)[-1] == name else getattr(mod, name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return __all__
