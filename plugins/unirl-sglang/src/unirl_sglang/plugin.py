"""The ``unirl.plugins`` entry point of ``unirl-sglang``.

Factories are lazy ``"module:attr"`` strings and preflight reads only the recipe, so loading this
module imports neither torch nor SGLang.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from unirl.api import Violation, hookimpl

SOURCE = "unirl-sglang"


@hookimpl
def unirl_rollout_engines() -> dict[str, str]:
    return {"sglang": "unirl_sglang.engine:SGLangEngine"}


@hookimpl
def unirl_weight_syncs() -> dict[str, str]:
    return {"sglang": "unirl_sglang.sync:SGLangWeightSync"}


@hookimpl
def unirl_preflight(config: Any, kernel: Any) -> list[Violation]:
    """What is wrong with a run that selects the sglang engine, found before any server is contacted.

    Option fields are core's check (``SGLangEngine.Config``), the engine/sync pairing too; this adds
    what needs the recipe as a whole."""
    if config.rollout.engine != "sglang":
        return []
    from unirl.api import OptionsError

    try:  # the kernel's one validation against SGLangEngine.Config (no second parse here)
        options = kernel.options("rollout_engines", "sglang", config.rollout.options, "rollout.options")
    except OptionsError:
        return []  # reported field by field, once, by core's options check
    out: list[Violation] = []
    if options.launch is not None:
        module = options.launch.module
        if options.launch.python is None and importlib.util.find_spec(module.split(".")[0]) is None:
            out.append(Violation(SOURCE, "rollout.options.launch.module",
                                 f"{module} is not importable here, so the servers cannot be launched",
                                 "pip install sglang==0.5.23 (a CUDA machine), or point rollout.options.servers "
                                 "at running servers"))
    if (not options.original_logprobs and config.rollout.temperature != 1.0
            and config.algorithm.old_logp_source == "rollout"):
        out.append(Violation(SOURCE, "rollout.options.original_logprobs",
                             "without SGLANG_RETURN_ORIGINAL_LOGPROB=1 SGLang returns log-probs after temperature "
                             f"({config.rollout.temperature}), but algorithm.old_logp_source is 'rollout' "
                             "(they would stand in for pi_old)",
                             "run the servers with SGLANG_RETURN_ORIGINAL_LOGPROB=1 and set original_logprobs: "
                             "true, or use old_logp_source: replay"))
    return out
