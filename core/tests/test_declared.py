"""Components declare their layout (issue 72): the engine's workers, TP, serving dtype and switches, the
actor's ranks, compute dtype and compilation, the controller's environments and turns. Core resolves
them once (:mod:`unirl.declared`) for preflight, the ``Runtime`` and every plugin's ``unirl_preflight``;
a check reads them, never a component's name."""

from __future__ import annotations

import types

from unirl.api import ActorCapabilities, Capabilities, ControllerCapabilities, EngineCapabilities, dtype_name
from unirl.config import load_config
from unirl.contracts import RolloutController
from unirl.declared import resolve
from unirl.kernel.hookspecs import hookimpl
from unirl.kernel.manager import load_kernel
from unirl.preflight import preflight
from unirl.runtime import build_runtime


def _controller(cls_name: str, caps: ControllerCapabilities | Exception) -> type:
    def capabilities(cls, config):
        if isinstance(caps, Exception):
            raise caps
        return caps

    def abstract(self, *a, **k):
        raise NotImplementedError

    body = {"capabilities": classmethod(capabilities), "collect": abstract, "metrics": abstract,
            "warm_start_samples": abstract, "close": abstract}
    return type(cls_name, (RolloutController,), body)


def _plugin(name: str, **hooks) -> types.ModuleType:
    mod = types.ModuleType(name)
    for hook, value in hooks.items():
        setattr(mod, hook, hookimpl(value))
    return mod


def test_core_components_declare_what_their_options_set():
    kernel = load_kernel()
    config = load_config(None, ["rollout.options={dtype: bfloat16}", "actor.options={compile: true, "
                                "compute_dtype: bfloat16}", "rollout.logprobs=processed"])
    caps, broken = resolve(config, kernel)
    assert broken == []
    assert (caps.engine.workers, caps.engine.tensor_parallel, caps.engine.serve_dtype) == (1, 1, "bfloat16")
    assert caps.engine.served_logprobs == "processed_logprobs" and caps.engine.eager is None  # no such switch
    assert caps.engine.field_of("serve_dtype") == "rollout.options.dtype"
    assert caps.actor == ActorCapabilities(ranks=1, compute_dtype="bfloat16", compiled=True)
    assert caps.actor.field_of("compiled") == "actor.options.compile"
    assert caps.controller == ControllerCapabilities(drives_environments=False, multi_turn=False)  # batch
    plain, _ = resolve(load_config(None, []), kernel)
    assert plain.engine.serve_dtype is None and plain.actor == ActorCapabilities()


def test_dtype_names_follow_model_dtype():
    assert [dtype_name(v) for v in ("torch.bfloat16", "bf16", "float", "fp32", "float32", None)] == [
        "bfloat16", "bfloat16", "float32", "float32", "float32", None]


def test_an_environment_needs_a_controller_that_declares_it_drives_one():
    """Declarations, not names: a third-party single-turn controller is refused with an environment, one
    that declares ``drives_environments`` passes that check (and batch, core's own, is refused)."""
    single = _controller("Single", ControllerCapabilities())
    driver = _controller("Driver", ControllerCapabilities(drives_environments=True, multi_turn=True))
    kernel = load_kernel(extra=[("ctl", _plugin("ctl_plugin", unirl_rollout_controllers=lambda: {
        "single": single, "driver": driver}))])

    def env_fields(controller: str) -> list[str]:
        config = load_config(None, [f"rollout.controller={controller}", "rollout.environment=tool_env"])
        return [v.message for v in preflight(config, kernel)
                if v.field == "rollout.environment" and "runs its turns" in v.message]

    assert len(env_fields("single")) == 1 and "'single'" in env_fields("single")[0]
    assert len(env_fields("batch")) == 1
    assert env_fields("driver") == []


def test_a_broken_declaration_is_reported_once_naming_the_plugin():
    broken = _controller("Broken", RuntimeError("boom"))
    kernel = load_kernel(extra=[("ctl", _plugin("ctl_plugin2", unirl_rollout_controllers=lambda: {"broken": broken}))])
    got = [v for v in preflight(load_config(None, ["rollout.controller=broken"]), kernel)
           if "capabilities() of 'broken'" in v.message]
    assert len(got) == 1 and got[0].field == "rollout.controller" and "boom" in got[0].message


def test_plugins_and_the_runtime_get_the_same_declarations():
    seen: list[Capabilities] = []

    def unirl_preflight(config, capabilities):
        seen.append(capabilities)
        return []

    kernel = load_kernel(extra=[("spy", _plugin("spy_plugin", unirl_preflight=unirl_preflight))])
    config = load_config(None, ["rollout.options={dtype: bfloat16}"])
    preflight(config, kernel)
    assert len(seen) == 1 and isinstance(seen[0].engine, EngineCapabilities)
    assert seen[0].engine.serve_dtype == "bfloat16"
    assert build_runtime(config, kernel).capabilities == seen[0]
