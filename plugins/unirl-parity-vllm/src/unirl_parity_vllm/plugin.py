"""The ``unirl.plugins`` entry point of ``unirl-parity-vllm`` (``parity``).

Loading this module imports neither torch nor vLLM: factories are lazy strings and every hook imports
what it needs only when parity is enabled (``UNIRL_PARITY_ENABLE=1``). With the flag absent every
hook is a no-op: no provider is enabled (core then installs nothing), the gate returns at once, no
environment is propagated, no artifact is written, and preflight reports nothing unless the recipe
opts in to parity (``plugins.parity.enabled: true``): that run is refused, since it would train with
no gate (:func:`unirl_parity_vllm.profile.flag_violations`).
"""

from __future__ import annotations

from typing import Any

from unirl.api import hookimpl
from unirl_parity_vllm import ENV_FLAG, parity_enabled
from unirl_parity_vllm.paths import PROVIDERS  # re-exported

SOURCE = "unirl-parity-vllm"
#: the name of this distribution's ``vllm.general_plugins`` entry point (parity B's ``vllm_side``)
VLLM_PLUGIN_NAME = "unirl_parity"


#: the model families this distribution provides, each with a profile of this release: the one list
#: (``profile.CONTRACT.parity_adapters`` is built from it; any other family needs evidence)


@hookimpl
def unirl_parity_providers() -> dict[str, str]:
    return dict(PROVIDERS)


@hookimpl
def unirl_config_sections() -> dict[str, str]:
    return {"parity": "unirl_parity_vllm.profile:ParityProfile"}


@hookimpl
def unirl_commands() -> dict[str, str]:
    """``unirl parity report ARTIFACT`` (core's CLI dispatches the ``parity`` command here)."""
    return {"parity": "unirl_parity_vllm.report:main"}


@hookimpl
def unirl_worker_env(config: Any) -> dict[str, str]:
    """Every Ray worker and vLLM process gets the opt-in, and vLLM loads only this distribution's
    general plugin (``VLLM_PLUGINS`` is vLLM's allowlist of entry-point names)."""
    if not parity_enabled():
        return {}
    from unirl_parity_vllm.paths import DIR_ENV, parity_dir

    env = {ENV_FLAG: "1", DIR_ENV: str(parity_dir(config))}  # absolute: remote ranks write gate records there
    from unirl_parity_vllm.profile import CONTRACT

    engine = getattr(getattr(config, "rollout", None), "engine", None)
    if CONTRACT.engine_packages.get(engine) == "vllm":  # the engine's parity side runs in vLLM's processes
        from unirl_parity_vllm.vllm_side.installer import MANIFEST_DIR_ENV

        env["VLLM_PLUGINS"] = VLLM_PLUGIN_NAME
        # the vLLM side reads the profile's strict mode (an unreadable profile: strict, fail closed; preflight
        # has reported it already)
        from unirl_parity_vllm.profile import declared
        from unirl_parity_vllm.vllm_side import PLATFORM_ENV, STRICT_ENV, TP_CACHE_ENV

        try:
            profile = declared(config)
            env[STRICT_ENV] = "1" if profile.strict else "0"
            # the platform whose kernels the vLLM side replaces (its installer refuses any other)
            env[PLATFORM_ENV] = profile.platform
            if profile.tp_gather_cache is not None:
                env[TP_CACHE_ENV] = "1" if profile.tp_gather_cache else "0"
        except Exception:  # noqa: BLE001
            env[STRICT_ENV] = "1"
            env[PLATFORM_ENV] = "cpu"
        # every vLLM process (main, EngineCore, Worker) writes its install manifest here; the artifact
        # collects them (engine_manifests)
        env[MANIFEST_DIR_ENV] = str(parity_dir(config) / "vllm")
    return env


@hookimpl
def unirl_preflight(config: Any, adapter: Any, kernel: Any, capabilities: Any = None) -> list:
    """With the flag: the whole parity contract, read from what the engine and actor declare
    (``capabilities``; None: resolved from ``kernel``). Without it, a recipe that opts in to parity
    (``plugins.parity.enabled``) is refused, naming the flag (it would train with no gate), after the
    extra of this package it needs (``[vllm]``, ``[fsdp]``) if one is missing; a recipe that does not
    opt in gets nothing. Both before Ray starts or any model is built."""
    if not parity_enabled():
        from unirl_parity_vllm.profile import flag_violations

        return flag_violations(config)
    from unirl_parity_vllm.artifact import remember
    from unirl_parity_vllm.rules import preflight

    if capabilities is not None:
        remember(config, capabilities)  # the run's recorder freezes the profile from these
    return preflight(config, adapter, kernel, capabilities)


@hookimpl
def unirl_before_backward(ctx: Any, config: Any) -> None:
    if not parity_enabled():
        return
    from unirl_parity_vllm.gate import check

    check(ctx, config)


@hookimpl
def unirl_on_rollout(phase: str, step: int, version: int, samples: Any, config: Any) -> None:
    """MoE routing diagnostics: each sample gets the engine's routing of its tokens (the gate compares)."""
    if not parity_enabled():
        return
    from unirl_parity_vllm.routing import attach

    attach(samples, config)


@hookimpl
def unirl_on_weights_published(version: int, receipts: list, config: Any) -> None:
    if not parity_enabled():
        return
    from unirl_parity_vllm.artifact import recorder

    recorder(config).on_weights_published(version, receipts)


@hookimpl
def unirl_on_step_end(step: int, metrics: dict, config: Any) -> None:
    if not parity_enabled():
        return
    from unirl_parity_vllm.artifact import recorder

    recorder(config).on_step_end(step, metrics)
