"""``run.allocator`` (unirl.allocator): with ``retain`` a block freed by one step is reused by the next without
the kernel faulting its pages in again; with the C library's defaults a large block is unmapped on free and
every reuse faults afresh. The oracle is the kernel's own count of minor page faults (``ru_minflt``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from unirl.config import load_config
from unirl.contracts import NullTracer
from unirl.kernel.manager import load_kernel

ROOT = Path(__file__).resolve().parents[2]

# two "steps" that each write two fresh 64 MB blocks through the C library's malloc (what torch's CPU
# tensors come from) and free them; the faults of the second step are the cost a training step pays again
PROBE = """
import ctypes, json, resource, sys
from unirl.allocator import give_back_freed_memory, retain_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
applied = retain_freed_memory() if sys.argv[1] == "retain" else None
def step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(64 << 20) for _ in range(2)]
    for b in blocks:
        ctypes.memset(b, 1, 64 << 20)
    for b in blocks:
        libc.free(b)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
first, second = step(), step()
given_back = give_back_freed_memory()
print(json.dumps({"applied": applied, "first": first, "second": second, "given_back": given_back, "third": step()}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_retained_memory_is_reused_without_faulting_its_pages_in_again():
    retain, system = _probe("retain"), _probe("system")
    pages = 2 * (64 << 20) // 4096
    assert retain["applied"] is True
    assert system["first"] > pages // 8 and retain["first"] > pages // 8  # a first touch faults either way
    assert system["second"] > pages // 8, system  # unmapped on free: faulted in again
    assert retain["second"] < pages // 100, retain  # the same heap pages, no fault
    assert retain["given_back"] and retain["third"] > pages // 8, retain  # after the run: back to the kernel


def test_train_retains_memory_for_the_run_and_gives_it_back_after(tmp_path, monkeypatch):
    import unirl.trainer.loop as loop

    calls: list[str] = []

    class Components:  # what the loop closes after an attempt
        tracer = NullTracer()  # a crashed attempt closes its tracer (the run's state says it is open)
        actor = None  # the memory recorder asks an actor for its ranks' peaks; this attempt never gets there

        def close(self):
            calls.append("close")

    def attempt(run, **kwargs):
        calls.append("train")
        raise RuntimeError("the attempt ends")

    import unirl.allocator as allocator

    monkeypatch.setattr(allocator, "retain_freed_memory", lambda: calls.append("retain") or True)
    monkeypatch.setattr(allocator, "give_back_freed_memory", lambda: calls.append("give back") or True)
    monkeypatch.setattr(loop, "build_components", lambda *a, **k: calls.append("build") or Components())
    monkeypatch.setattr(loop, "_train", attempt)
    for mode, expected in (("retain", ["retain", "build", "train", "close", "give back"]),
                           ("system", ["build", "train", "close"])):
        calls.clear()
        config = load_config(ROOT / "recipes" / "arith-tiny.yaml", [f"run.output_dir={tmp_path / mode}",
                                                                    f"run.allocator={mode}", "trainer.progress=false"])
        with pytest.raises(RuntimeError, match="the attempt ends"):
            loop.train(config, load_kernel())
        assert calls == expected, mode
    with pytest.raises(Exception, match=r"run\.allocator"):
        load_config(None, ["run.allocator=jemalloc"])


def test_the_default_leaves_the_c_library_alone():
    """``system`` by default: ``retain`` held ~1 GB more peak RSS in fp32 at 100 M for at most a few
    percent (docs/operations.md, "Memory the trainer frees"); a bf16 run opts in."""
    assert load_config(None, []).run.allocator == "system"



def test_trim_after_transient_gives_pages_back_only_under_system(monkeypatch):
    """What the FSDP rank calls after each train step and weight stream (its measured effect is in the
    function's docstring): ``system`` hands the free pages back, ``retain`` keeps them, as that mode asks."""
    import unirl.allocator as allocator

    calls: list[str] = []
    monkeypatch.setattr(allocator, "give_back_freed_memory", lambda: calls.append("give back") or True)
    assert allocator.trim_after_transient("retain") is False and calls == []
    assert allocator.trim_after_transient("system") is True and calls == ["give back"]
