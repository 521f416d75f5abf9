"""The vLLM worker extension that loads a weight sync inside each engine worker.

vLLM mixes this class into its worker (``worker_extension_cls``), so ``LLM.collective_rpc("unirl_...")``
runs these methods in every worker, in-process or in spawned worker processes (so this module must
stay importable there, and method names must not clash with the worker's own ``update_weights`` or
``reload_weights``).

One sync is one session, never split across reload calls (a chunk boundary inside fused q/k/v
corrupts them silently):

* ``unirl_sync_begin(version)`` enters vLLM's layerwise reload (parameters go back to checkpoint
  format); with a ``manifest`` it first validates the whole of it against the worker's own checkpoint;
* ``unirl_sync_load(weights)`` checks a bucket's names, shapes and dtype against that checkpoint, then
  feeds it to ``model.load_weights``; vLLM buffers each layer until all its parts arrived, then
  processes (re-packs) it. The bucket is folded into the receipt's fingerprint as it passes and not kept:
  the sync is streamed (:mod:`unirl_vllm.stream`), so a worker holds a bucket, not the model;
* ``unirl_sync_finish()`` checks that every tensor arrived, finalizes, **owns the CPU weight packing**
  (see :meth:`_unirl_repack_cpu`), and returns the receipt: (worker rank, TP rank, version, fingerprint of
  exactly what it received, in order, and the fingerprint of the shard it now holds). Under tensor
  parallelism every rank receives the full tensors and ``model.load_weights`` cuts its own shard through
  vLLM's weight loaders.
"""

from __future__ import annotations

import time
from typing import Any

from unirl.api import TIED_HEAD, Fingerprint, WeightSpec, WeightSyncError, fingerprint


class UniRLWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner``, ``self.rank``)."""

    def unirl_routing_install(self) -> dict[str, int]:
        """R3: record each fed token's expert ids in this worker (:func:`unirl_vllm.routing.install`)."""
        from unirl_vllm import routing

        return routing.install(self)

    def unirl_routing_take(self) -> dict[str, Any]:
        """R3: the records filed since the last call, by request id (:func:`unirl_vllm.routing.take`)."""
        from unirl_vllm import routing

        return routing.take(self)

    def unirl_ping(self) -> dict[str, Any]:
        """Prove the extension is installed (the engine calls it at start-up)."""
        from unirl_vllm.compat import check_vllm

        return {"rank": int(getattr(self, "rank", 0)), "vllm": check_vllm()}

    def _unirl_model(self) -> Any:
        return self.model_runner.get_model()

    def _unirl_spec(self) -> WeightSpec:
        spec = getattr(self, "_unirl_weight_spec", None)
        if spec is None:
            mc = self.vllm_config.model_config
            spec = WeightSpec.from_checkpoint(mc.model, str(mc.dtype))
            self._unirl_weight_spec = spec
        return spec

    def unirl_sync_begin(self, version: int, manifest: list[tuple[str, tuple[int, ...], str]] | None = None,
                         kept: list[str] | None = None) -> None:
        """Enter the layerwise reload (after validating ``manifest``, when given). Nothing is touched on failure.
        ``kept``: names this sync leaves out on purpose (the worker holds them unchanged, :mod:`unirl.sync.held`);
        vLLM's finalize puts a layer that received nothing back as it was."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if getattr(self, "_unirl_session", None) is not None:
            raise WeightSyncError("a weight sync session is already open on this worker")
        if manifest is not None:
            self._unirl_spec().check_manifest(manifest, kept or ())
        model = self._unirl_model()
        initialize_layerwise_reload(model)
        self._unirl_session = {"version": int(version), "digest": Fingerprint(), "manifest": [], "names": set(),
                               "t0": time.perf_counter(), "fed": 0, "kept": frozenset(kept or ())}

    def unirl_sync_load(self, weights: list[tuple[str, Any]] | None = None, path: str | None = None) -> int:
        """Load one bucket (tensors, or a safetensors file for multiprocess engines); returns its size."""
        session = getattr(self, "_unirl_session", None)
        if session is None:
            raise WeightSyncError("unirl_sync_load outside a session (call unirl_sync_begin first)")
        if path is not None:
            from safetensors import safe_open

            with safe_open(path, framework="pt") as handle:
                order = (handle.metadata() or {}).get("order", "")
                names = order.split("\n") if order else list(handle.keys())
                weights = [(n, handle.get_tensor(n)) for n in names]
        weights = list(weights or [])
        spec = self._unirl_spec()
        for name, t in weights:  # the whole bucket before any of it reaches the model
            if name in session["names"]:
                raise WeightSyncError(f"tensor '{name}' was sent twice in one sync")
            spec.check_one(name, tuple(t.shape), str(t.dtype))
            session["names"].add(name)
        # A tied head is fingerprinted (it was sent) but not fed: vLLM's Qwen3 loader would write it
        # through the lm_head alias; the embedding carries the values and _unirl_repack_cpu re-packs the head.
        feed = [(n, t) for n, t in weights if not (spec.tied_head and n == TIED_HEAD)]
        session["fed"] += 1
        self._unirl_model().load_weights(feed)
        for name, t in weights:
            session["digest"].update(name, t)
            session["manifest"].append((name, tuple(t.shape), str(t.dtype)))
        return len(weights)

    def unirl_sync_finish(self) -> dict[str, Any]:
        """Check the set complete, finalize the reload, re-pack on the CPU, drop stale caches, and return this
        worker's receipt. An incomplete set raises with the session still open (the engine aborts it)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        session = getattr(self, "_unirl_session", None)
        if session is None:
            raise WeightSyncError("unirl_sync_finish outside a session")
        self._unirl_spec().check_manifest(session["manifest"], session["kept"])
        model = self._unirl_model()
        try:
            finalize_layerwise_reload(model, self.vllm_config.model_config)
            self._unirl_repack_cpu(model)
            self._unirl_prepack_cpu_experts(model)
            for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
                fn = getattr(self.model_runner, reset, None)
                if callable(fn):
                    fn()
            held = self.unirl_shard_fingerprint()
        finally:
            self._unirl_session = None
        return {
            "worker": int(getattr(self, "rank", 0)),
            "tp_rank": self._unirl_tp_rank(),
            "version": session["version"],
            "fingerprint": session["digest"].hexdigest(),
            "shard_fingerprint": held,
            "num_tensors": session["digest"].count,
            "seconds": time.perf_counter() - session["t0"],
        }

    def _unirl_tp_rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())

    def unirl_shard_fingerprint(self) -> str:
        """Fingerprint of what this worker holds: its parameters as vLLM's weight loaders cut them (its TP
        shard), in ``named_parameters`` order. Weights packed into opaque CPU GEMM handles (plain vLLM-cpu,
        not under the parity plugin, which keeps them live) are empty tensors here and add only their name."""
        return fingerprint((n, p.detach()) for n, p in self._unirl_model().named_parameters()
                           if not getattr(p, "is_meta", False))

    def unirl_sync_abort(self) -> bool:
        """Leave a session. Before any bucket was loaded this restores the old weights exactly (vLLM
        places the saved kernel tensors back); after, the engine must be reloaded (the caller does)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        session = getattr(self, "_unirl_session", None)
        if session is None:
            return True
        self._unirl_session = None
        finalize_layerwise_reload(self._unirl_model(), self.vllm_config.model_config)
        self._unirl_repack_cpu(self._unirl_model())
        return session["fed"] == 0

    @staticmethod
    def _unirl_repack_cpu(model: Any) -> int:
        """Re-run vLLM's CPU GEMM dispatch on every module that keeps its weight (embeddings, heads).

        On the CPU, vLLM packs each linear weight into a oneDNN handle captured by ``layer.cpu_linear``.
        The layerwise reload re-packs the layers it loaded, but a *tied* ``lm_head`` is never loaded
        itself (its weight is the embedding's): its ``cpu_linear`` would keep the packed copy of the old
        embedding and serve stale logits silently (platform note, trap 2). Linear layers packed with
        ``remove_weight=True`` hold an empty weight and were re-packed by the reload; modules that still
        hold a 2-D weight were packed with ``remove_weight=False`` and are re-packed here, from the live
        weight. Returns how many modules were re-packed.
        """
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        count = 0
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not hasattr(module, "cpu_linear") or weight is None:
                continue
            if getattr(weight, "is_meta", False) or weight.ndim != 2 or weight.numel() == 0:
                continue
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            count += 1
        return count

    @staticmethod
    def _unirl_prepack_cpu_experts(model: Any) -> int:
        """Re-run the CPU experts' prepack on every MoE layer whose kernel vLLM set up, after a full reload.

        vLLM 0.32's ``UnquantizedFusedMoEMethod._setup_kernel`` calls the experts'
        ``process_weights_after_loading`` (on the CPU: the grouped-GEMM prepack of ``w13``/``w2``) only on
        the first load. On a weight update it copies the new checkpoint-layout weights into the parameters
        and skips the prepack, so the CPU MoE kernel reads plain weights as packed ones: after a sync that
        changed nothing, a tiny Qwen3-MoE's fp32 log-probs moved by 0.05 on average and its routing agreed
        with the trainer's on 0.88 of the choices (1.0 before), and training drifted to a mean |dlogp| of 2.
        Only after a complete set (every layer was reloaded, so every layer holds plain weights now); a
        layer whose quant method keeps the weights plain (the parity profile) has no kernel and is skipped.
        """
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        count = 0
        for module in model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if isinstance(experts, CPUUnquantizedExperts):
                experts.process_weights_after_loading(module)
                count += 1
        return count
