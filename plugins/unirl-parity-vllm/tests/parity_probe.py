"""Helpers of ``test_e2e_vllm_fsdp.py`` (not a test module). Importable by the FSDP ranks: the test puts
this directory on ``sys.path``, and the rank group passes the root of ``actor.options.worker_cls`` and of
in-process plugins on to every rank.

* :class:`ProbeWorker` (``actor.options.worker_cls``): an :class:`~unirl_fsdp.worker.FSDPWorker` that,
  at its first before-backward agreement and at any failing one, writes what the rank saw to
  ``$UNIRL_PARITY_DIR/probe-rank<r>-<first|fail>.json``: the worker env, the parity provider it
  unpickled, whether the ``qwen3`` patches were in place and every (FSDP2-managed) ``nn.Linear``
  resolves to the patched forward, and on a failure whether parameters, gradients and the optimizer
  step are untouched.
* :func:`perturbed_publish`: patched over ``VLLMWeightSync.publish`` in the trainer's process only (the
  sync runs there; preflight sees the verified ``vllm`` sync): one element of one tensor moved by 1e-3
  *before staging*, so the engine serves (and fingerprints) weights the actor does not hold.
* ``python parity_probe.py OUT.json MODEL_DIR``: one real vLLM engine (in-process) through the run's
  kernel and runtime, fixed prompts and seeds; writes tokens, log-probs and what was installed.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

from unirl.api import InProcessSync
from unirl_fsdp.worker import FSDPWorker

PERTURBED = "model.layers.0.mlp.down_proj.weight"


def perturbed_publish(self: Any, actor: Any, engine: Any, version: int):
    """``InProcessSync.publish`` with one element of :data:`PERTURBED` moved by 1e-3 before staging."""
    def named():
        for name, tensor in actor.named_weights():
            if name == PERTURBED:
                tensor = tensor.detach().clone()
                tensor[3, 5] += 1e-3
            yield name, tensor

    return InProcessSync.publish(self, types.SimpleNamespace(named_weights=named), engine, version)


class ProbeWorker(FSDPWorker):
    def setup(self, *args: Any) -> dict[str, Any]:
        out = super().setup(*args)
        self._probe_initial = {n: p.to_local().detach().clone() for n, p in self.model.named_parameters()}
        self._probe_first = True
        return out

    def _probe(self, kind: str, error: BaseException | None) -> None:
        import torch

        from unirl_parity_vllm import providers

        linears = [m for m in self.model.modules() if isinstance(m, torch.nn.Linear)]
        params = dict(self.model.named_parameters())
        doc = {
            "rank": self.rank,
            "env": {k: os.environ.get(k) for k in ("UNIRL_PARITY_ENABLE", "UNIRL_PARITY_DIR")},
            "provider": type(self.runtime.parity).__qualname__ if self.runtime.parity is not None else None,
            "patched": providers.installed(),
            "linears": len(linears),
            "linears_patched": sum(type(m).forward is providers.linear_forward for m in linears),
            "fsdp_modules": sorted({type(m).__name__ for m in self.model.modules() if type(m).__name__.startswith("FSDP")}),
            "dtensor_params": sum(type(p).__name__ == "DTensor" for p in params.values()),
            "error": type(error).__name__ if error is not None else None,
            "optimizer_step": self.step,
            "params_unchanged": all(torch.equal(self._probe_initial[n], p.to_local()) for n, p in params.items()),
            "grads_none": all(p.grad is None for p in params.values()),
        }
        path = Path(os.environ["UNIRL_PARITY_DIR"]) / f"probe-rank{self.rank}-{kind}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1))

    def _agree(self, error: BaseException | None) -> None:
        if self._probe_first:
            self._probe_first = False
            self._probe("first", error)
        try:
            super()._agree(error)
        except BaseException as exc:
            self._probe("fail", exc)
            raise


def engine_outputs(out_json: str, model_dir: str) -> dict[str, Any]:
    """One in-process vLLM engine built the trainer's way (kernel -> runtime -> engine); 8 prompts x
    32 tokens, fixed seeds. Nothing here imports unirl_parity_vllm."""
    import importlib

    import torch

    from unirl.api import (
        Qwen3Adapter,
        RunConfig,
        Sample,
        SamplingParams,
        build_engine,
        build_runtime,
        expand,
        load_kernel,
    )

    original_linear = torch.nn.Linear.forward
    config = RunConfig.model_validate({
        "run": {"output_dir": str(Path(out_json).parent / "run"), "seed": 0},
        "model": {"path": model_dir},
        "rollout": {"engine": "vllm", "options": {"placement": "inprocess", "kv_cache_gb": 0.25, "max_model_len": 128,
                                                  "enforce_eager": True, "ignore_eos": True}},
        "weight_sync": {"name": "vllm"},
    })
    kernel = load_kernel()
    adapter = Qwen3Adapter()
    runtime = build_runtime(config, kernel, adapter=adapter)
    engine = build_engine(config, adapter=adapter, runtime=runtime)
    try:
        g = torch.Generator().manual_seed(7)
        roots = [Sample(id=f"p{i}", prompt_ids=torch.randint(3, 250, (int(torch.randint(3, 20, (1,), generator=g)),),
                                                             generator=g).tolist()) for i in range(8)]
        samples = engine.generate(expand(roots, 1, tag="flag-absent", base_seed=5),
                                  SamplingParams(max_new_tokens=32, temperature=1.0, top_p=1.0, top_k=0))
    finally:
        engine.close()
    replaced = []
    if "unirl_parity_vllm.vllm_side.symbols" in sys.modules:
        symbols = importlib.import_module("unirl_parity_vllm.vllm_side.symbols")
        for t in symbols.COMMON:
            owner, attr = t.owner_and_attr()
            obj = getattr(owner, attr)
            if "unirl_parity" in str(getattr(obj, "__module__", "")):
                replaced.append(t.qualname)
    result = {
        "tokens": [s.response_ids for s in samples],
        "logprobs": [[float(x) for x in s.rollout_logprobs] for s in samples],
        "unirl_plugins": sorted(p.entry_point for p in kernel.plugins if p.status == "loaded"),
        "parity_providers": sorted(kernel.names("parity_providers")),
        "runtime_parity": runtime.parity is not None,
        "parity_modules": sorted(m for m in sys.modules if m.startswith("unirl_parity_vllm")),
        "vllm_installed": bool(sys.modules.get("unirl_parity_vllm.vllm_side.installer")
                               and sys.modules["unirl_parity_vllm.vllm_side.installer"].installed()),
        "vllm_replaced": replaced,
        "torch_linear_original": torch.nn.Linear.forward is original_linear
                                 and torch.nn.Linear.forward.__module__ == "torch.nn.modules.linear",
        "env": {k: os.environ.get(k) for k in ("UNIRL_PARITY_ENABLE", "UNIRL_PLUGINS", "VLLM_PLUGINS")},
    }
    Path(out_json).write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    engine_outputs(sys.argv[1], sys.argv[2])
