"""The contracts every engine, actor, weight-sync transport and model adapter serves.

Several implementations exist for each (embedded torch, vLLM, SGLang; embedded actor, FSDP), so each
contract is written once, as an abstract class with the *why* of every method, in a module of its
concern: :mod:`.capabilities` (what components declare), :mod:`.sampling`, :mod:`.engine`,
:mod:`.actor`, :mod:`.weight_sync` (transport, receipts, ledger), :mod:`.model` (model adapters),
:mod:`.controller` (controllers, environments, tools) and :mod:`.services` (parity, tracing, trackers,
batch rewards). This package re-exports them all, so ``from unirl.contracts import X`` is the one
spelling. Types only: no torch import at module load (tensors appear in annotations as strings).
"""

from unirl.contracts.actor import (
    Actor,
    BackwardContext,
    BeforeBackward,
    ExactContext,
    StepInfo,
)
from unirl.contracts.capabilities import (
    ActorCapabilities,
    Capabilities,
    ControllerCapabilities,
    EngineCapabilities,
    EstimatorTraits,
    dtype_name,
    traits_of,
)
from unirl.contracts.controller import Environment, EnvStep, RolloutController, Tool, ToolResult
from unirl.contracts.engine import Handle, RolloutEngine
from unirl.contracts.model import ModelAdapter, hf_config_keys
from unirl.contracts.sampling import SamplingParams, stop_token_ids
from unirl.contracts.services import BatchReward, NullTracer, ParityProvider, TraceExporter, Tracker
from unirl.contracts.weight_sync import (
    ADAPTER_WEIGHTS,
    Receipt,
    VersionLedger,
    WeightSync,
    adapter_fingerprint,
    fingerprint,
    verify_receipts,
)

__all__ = [
    "ActorCapabilities", "Capabilities", "ControllerCapabilities", "dtype_name",
    "ADAPTER_WEIGHTS", "Actor", "BackwardContext", "BatchReward", "BeforeBackward", "EngineCapabilities",
    "EnvStep", "Environment", "EstimatorTraits", "ExactContext", "Handle", "ModelAdapter", "NullTracer",
    "ParityProvider", "Receipt", "RolloutController", "RolloutEngine", "SamplingParams", "StepInfo", "Tool",
    "ToolResult", "TraceExporter", "Tracker", "VersionLedger", "WeightSync", "adapter_fingerprint",
    "fingerprint", "hf_config_keys", "stop_token_ids", "traits_of", "verify_receipts",
]
