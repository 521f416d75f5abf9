"""``actor.options.compile`` of the embedded actor: ``torch.compile`` of each decoder layer's MLP and
RMSNorms, the rest eager, compiled once at start-up by a warm-up whose time is reported apart.

Why these regions: they hold the elementwise ops a compiler fuses (``silu(gate) * up``; an RMSNorm's
pow, mean, rsqrt and muls), while the packed attention (:mod:`unirl.packing`), which gathers sequences
by ``position_ids``, breaks a graph: compiling whole decoder layers recompiled and ran slower (a 25 M
bf16 train phase 3.48-4.43 s against eager 3.40-3.67). Measured on the AMD EPYC, 2 threads: these
regions took the 25 M / 100 M bf16 train phases 2-3 % down, inside the step-to-step spread, for 7-15 s
of compiling (``benchmarks/README.md``, issue 38). So it is an option, off by default: worth it on a
long run, or where the CPU's or GPU's compiled kernels gain more.

``Module.compile`` compiles in place: parameter names do not change, so checkpoints, weight sync, the
HF export and a deep-copied KL reference (which runs eager) see the same model. ``dynamic=True``: packed
micro-batches change length every step, and one graph serves every length.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

#: the module classes compiled, by name suffix: transformers' ``Qwen3MLP``, ``LlamaRMSNorm``, ...
REGIONS = ("MLP", "RMSNorm")


def compile_regions(model: torch.nn.Module) -> int:
    """Mark every MLP and RMSNorm module of ``model`` for compiling (in place); the number marked."""
    marked = 0
    for module in model.modules():
        if type(module).__name__.endswith(REGIONS):
            module.compile(dynamic=True)
            marked += 1
    if marked == 0:
        raise ValueError(f"actor.options.compile: {type(model).__name__} has no module named *MLP or *RMSNorm to "
                         "compile; leave actor.options.compile unset for this model")
    return marked


def warm_up(model: torch.nn.Module, step: Callable[[bool], None]) -> float:
    """Seconds to compile: ``step(grad)`` runs a tiny forward (and, with ``grad``, its backward) through
    the actor's own path, once with gradients and once without (the replay's graphs), so the first
    training step pays no compiling. The gradients it leaves are cleared."""
    t0 = time.perf_counter()
    step(True)
    with torch.no_grad():
        step(False)
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0
