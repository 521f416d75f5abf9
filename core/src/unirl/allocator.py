"""The trainer's process can keep the memory it frees (``run.allocator: retain``; the default ``system``
leaves the C library alone).

Why: a train step allocates the same activation buffers every step, tens of MB each. glibc's malloc
serves a block that large with ``mmap`` and unmaps it on free (its dynamic threshold stops at 32 MB),
and trims the heap's free top, so every step faults the same pages in afresh, each zero-filled by the
kernel. An elementwise op writing a fresh 30 MB output costs several times one writing reused memory
(a bf16 mul of two ``[4928, 3072]`` tensors, 2 cores: 11-13 ms against 2.4 ms). With the mmap threshold
at 1 GiB and trimming off, a step reuses the previous step's pages: ``benchmarks/vs_trl.py``'s 100 M x 64
bf16 cell (UniRL's side, two interleaved pairs of fresh processes) trained in 6.06 / 5.92 s a step against
6.96 / 6.60 s, whole steps ~9.9 s against ~10.7 s, at the same peak RSS (4,781-4,832 MB); on an AMD EPYC
13.6-13.8 s against 14.9-15.4 s, peak RSS 4,585 against 4,674 MB.

Why it is not the default: in fp32 it gains at most a few percent (nothing measurable at 3 M and 25 M x 64; at 100 M x 64 on
the AMD EPYC a train phase of 25.4-27.4 s against 27.0-28.0 s) and at 100 M it raised peak RSS from 4,721 to
5,680 MB, above TRL's 4,697 (not broken down further: a heap that is never trimmed keeps what fp32's larger
blocks leave free). So it is a setting for bf16 compute, where the page faults are a visible share of the
cheaper elementwise ops.

What it costs: memory the process frees stays its own while it trains, so RSS holds its high-water mark;
``train()`` hands the free pages back when a run ends (:func:`give_back_freed_memory`), for a process
that goes on to other work (a notebook, a test session). ``system`` keeps the C library's defaults. Only glibc
has ``mallopt``: elsewhere (musl, macOS) nothing changes, and :func:`retain_freed_memory` says so."""

from __future__ import annotations

import ctypes
import functools
from typing import Literal

Mode = Literal["retain", "system"]  # run.allocator

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap and return to it


@functools.cache
def retain_freed_memory() -> bool:
    """Set glibc's mmap threshold to 1 GiB and turn heap trimming off, once per process; False where the C
    library has no ``mallopt`` or refuses (nothing changed)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1


def give_back_freed_memory() -> bool:
    """Return the free pages of every heap to the kernel (glibc ``malloc_trim(0)``); False where there is
    no ``malloc_trim``. The settings of :func:`retain_freed_memory` stay: the next run refills the heap."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def apply_allocator(mode: Mode) -> bool:
    """What a process that trains calls once it knows ``run.allocator`` (the trainer's process and every
    FSDP rank): ``retain`` keeps freed memory, ``system`` leaves the C library alone. True when changed."""
    return mode == "retain" and retain_freed_memory()


def trim_after_transient(mode: Mode) -> bool:
    """What a process calls after it freed a model-sized transient (a weight stream's gathered buckets, a
    train step's activations and gathered shards): under ``system`` the free pages go back to the kernel;
    under ``retain`` they stay, as that mode asks. True when trimmed.

    Why: glibc's dynamic mmap threshold rises to 32 MB after the first large free, so later blocks below it
    come from the heap, and a heap fragmented by many such blocks keeps its free pages. Measured on an FSDP
    rank (a 27 M-param model, 2 ranks, fp32, ``arith-tiny-fsdp``): between steps rank 0 held 455 MB above
    its loaded RSS (rank 1: 299 MB) against 162 MB of gradients and AdamW moments; trimmed after each train
    step and weight stream, 141 MB (rank 1: 120-130 MB), with the same in-step peaks."""
    return mode == "system" and give_back_freed_memory()


def release_allocator(mode: Mode) -> bool:
    """What ``train()`` calls after each attempt: under ``retain``, the pages the attempt kept go back to the
    kernel; under ``system`` there is nothing to give back."""
    return mode == "retain" and give_back_freed_memory()
