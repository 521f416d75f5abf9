"""Helpers for tests (core's and every plugin's); nothing here serves a run.

* :func:`default_runtime`: the :class:`~unirl.runtime.Runtime` ``train()`` would hand a component, for
  a test or benchmark that builds an engine or actor by hand. Components require a runtime and never
  build one themselves (a fallback to a freshly discovered kernel could see another plugin set than
  the run); this is the one place that builds the default. :func:`build_engine` and
  :func:`build_actor` build the selected engine or actor the way a run does (options validated by
  the kernel). All three are exported by ``unirl.api``, so a plugin's tests import them like any
  public name.
* :func:`count_prefill`: the context tokens an embedded engine's decoder actually prefills, counted
  from the tensors it is handed (an independent count of the computation, not the engine's own
  ``RequestRecord.cached_tokens`` claim). The fork tests of core and of ``unirl-agentic`` both need it.
* :func:`run_watched` and friends: the fault tests of several distributions (FSDP preemption, a vLLM
  replica lost mid-sync) each start ``unirl train`` in a child process, so the pytest process never
  initialises Ray itself, and then check that every process the run started (Ray's gcs_server and
  raylet, the ranks, the replicas) ended with it. That check was written twice; a plugin's tests
  import it from here. Needs ``psutil`` (a dependency of Ray, which every such test uses).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import RunConfig
    from unirl.runtime import Runtime


def default_runtime(config: RunConfig, *, adapter: Any = None) -> Runtime:
    """The runtime of ``config`` from a freshly discovered kernel (every installed plugin, as
    ``unirl train`` would load them), for a component a test builds outside ``train()``."""
    from unirl.kernel.manager import load_kernel
    from unirl.runtime import build_runtime

    return build_runtime(config, load_kernel(), adapter=adapter)


def build_engine(config: RunConfig, *, adapter: Any, tokenizer: Any = None, runtime: Runtime | None = None,
                 **kwargs: Any) -> Any:
    """``config.rollout.engine`` built as ``train()`` builds it: from a freshly discovered kernel, its
    ``rollout.options`` validated by the kernel and handed over typed, with :func:`default_runtime`
    unless ``runtime`` is given. ``kwargs`` go to the engine's factory (``model=`` for the torch
    engine). Why not the class itself: an engine reads only the options it is handed, so a test that
    wrote them into ``config`` and called the class would silently run on the defaults."""
    from unirl.kernel.manager import load_kernel
    from unirl.runtime import build_runtime
    from unirl.trainer.components import build_engine as build

    kernel = load_kernel()
    if runtime is None:
        runtime = build_runtime(config, kernel, adapter=adapter)
    return build(config, kernel, adapter=adapter, tokenizer=tokenizer, runtime=runtime, **kwargs)


def count_prefill(engine: Any) -> list[int]:
    """Wrap ``engine.decoder.prefill`` (the embedded :class:`~unirl.engine.torch_engine.TorchEngine`'s) so
    every call appends the number of real (non-pad) context tokens it ran through the model; returns
    that list (clear it between measurements). Why the decoder and not the engine's records: a shared
    prefill that silently recomputed the prefix would still report ``cached_tokens``; the tensors the
    model is given cannot."""
    prefilled: list[int] = []
    inner = engine.decoder.prefill

    def counting(ids: Any, pos: Any, valid: Any, max_new: int) -> Any:
        prefilled.append(int(valid[:, : ids.shape[1]].sum()))  # real context tokens run through the model
        return inner(ids, pos, valid, max_new)

    engine.decoder.prefill = counting
    return prefilled


def build_actor(config: RunConfig, *, adapter: Any, runtime: Runtime | None = None, **kwargs: Any) -> Any:
    """``config.actor.name`` built as ``train()`` builds it: ``actor.options`` validated by the kernel and
    handed over typed, with :func:`default_runtime` unless ``runtime`` is given; ``kwargs`` (``model=``,
    ``tokenizer=``) go to the factory. Same reason as :func:`build_engine`."""
    from unirl.kernel.manager import load_kernel
    from unirl.runtime import build_runtime

    kernel = load_kernel()
    if runtime is None:
        runtime = build_runtime(config, kernel, adapter=adapter)
    return kernel.build("actors", config.actor.name, options=config.actor.options, options_at="actor.options",
                        config=config, adapter=adapter, runtime=runtime, **kwargs)


def descendants(root: int) -> set[int]:
    """Every live process below ``root``."""
    import psutil

    try:
        return {p.pid for p in psutil.Process(root).children(recursive=True)}
    except psutil.Error:
        return set()


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run_watched(cmd: list[str], env: dict[str, str], cwd: Path, log: Path, *, timeout_s: float = 600,
                grace_s: float = 30) -> tuple[int, str, int]:
    """Run ``cmd`` to its end (output to ``log``), noting every process it starts; then assert none of
    them outlives it by more than ``grace_s`` (Ray's processes end with their driver, not at the same
    instant). Only this run's processes are counted, not other jobs' on a shared machine. Returns the
    exit code, the output and the driver's pid."""
    seen: set[int] = set()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                seen |= descendants(proc.pid)
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    text = log.read_text()
    deadline = time.monotonic() + grace_s
    while any(alive(p) for p in seen) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = sorted(p for p in seen if alive(p))
    assert not left, f"processes {left} outlived their driver: {text[-2000:]}"
    assert seen, "the run started no process (no Ray?)"
    return proc.returncode, text, proc.pid
