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
* :func:`sample_stale_batch`: the mismatch decomposition's stale batch (sampled at version 1, measured
  two publishes and three updates later), the same on the embedded engine and on vLLM, so core's and
  ``unirl-vllm``'s decomposition tests measure the same thing.
* :func:`teacher_forced_logprobs`: the vision-language oracle, one plain transformers forward of prompt
  + response with the pixels, that the embedded engine's and vLLM's image tests both hold log-probs to.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import RunConfig
    from unirl.mismatch.monitor import MismatchMonitor
    from unirl.runtime import Runtime
    from unirl.samples import Sample


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


def sample_stale_batch(config: RunConfig, c: Any) -> tuple[MismatchMonitor, list[Sample]]:
    """Through the built components ``c`` of ``config`` (``rollout.mode: async``, ``max_staleness`` >= 2):
    publish version 1, sample 2 groups x 4 at it, then train three updates on that batch with two more
    publishes in between. Returns the monitor (holding versions 1-3) and the batch, now two versions
    stale. The parity gate is switched off on the actor: it compares on-policy batches only, and this one
    is stale on purpose. Why shared: the decomposition's known answers (staleness == total under parity)
    must be checked on the same batch shape whichever engine sampled it."""
    import torch

    from unirl.contracts import SamplingParams, StepInfo, VersionLedger, stop_token_ids
    from unirl.data.datasets import load_prompts
    from unirl.mismatch.monitor import MismatchMonitor
    from unirl.rollout.controller import publish_next

    c.actor.set_before_backward(None)
    monitor, ledger = MismatchMonitor(config), VersionLedger()

    def publish() -> None:
        publish_next(ledger, c.sync, c.actor, c.engine, lambda v, *_: monitor.published(v, c.actor))

    publish()
    prompts, _ = load_prompts(config, c.tokenizer, "train")
    sampling = SamplingParams.from_config(config, stop_token_ids(config, c.tokenizer))
    samples = c.controller.collect(lambda k: prompts[:k], groups=2, n=4, sampling=sampling, launch_tag="t")
    g = torch.Generator().manual_seed(0)
    adv = [torch.randn(len(s.response_ids), generator=g) for s in samples]
    for k in range(3):
        c.actor.train_step(samples, {"advantages": adv}, StepInfo(rl_step=k))
        monitor.updated()
        if k < 2:
            publish()
    assert {v for s in samples for v in s.versions} == {1} and monitor.held == {1, 2, 3}
    return monitor, samples


def teacher_forced_logprobs(model: Any, s: Sample, processor: Any) -> Any:
    """The log-probs of ``s``'s response under one plain transformers forward of prompt + response (a
    Qwen2.5-VL ``model``), with the sample's pixels through ``processor`` and the positions left to the
    model's own ``get_rope_index`` (from ``mm_token_type_ids``). An oracle independent of any engine's
    decode path: neither the embedded engine's nor vLLM's placement of the image features is used."""
    import torch

    from unirl.multimodal import images_of

    ids = torch.tensor([s.prompt_ids + s.response_ids])
    kw = {}
    im = images_of(s)
    if im is not None:
        out = processor(images=list(im.images), return_tensors="pt")
        kw = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
              "mm_token_type_ids": (ids == model.config.image_token_id).int()}
    model.model.rope_deltas = None
    with torch.no_grad():
        logits = model(input_ids=ids, **kw).logits[0].float()
    lp = torch.log_softmax(logits[len(s.prompt_ids) - 1 : -1], dim=-1)
    return lp.gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
