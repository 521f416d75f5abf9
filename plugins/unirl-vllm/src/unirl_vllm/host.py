"""One vLLM engine, speaking plain data: :class:`Host` owns one ``vllm.LLM``.

``start`` adds requests, ``step`` runs one engine step and returns the new tokens of each request,
``abort_requests`` ends requests mid-generation, and the ``sync_*`` / ``load_adapter`` methods load
weights on every worker. Why plain data (token ids, floats, dicts): the same class runs in the
trainer's process or as a Ray actor (:class:`unirl_vllm.replicas.RayHost`) unchanged. The
trainer-facing engine that drives it is :class:`unirl_vllm.engine.VLLMEngine`.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unirl.api import (
    ADAPTER_WEIGHTS,
    UniRLError,
    WeightSyncError,
    adapter_fingerprint,
    now_ms,
)
from unirl_vllm.binding import BIND_ENV, thread_binding
from unirl_vllm.compat import check_vllm, is_cpu_build
from unirl_vllm.multimodal import image_token_of, placeholder_bias, placeholder_prompt
from unirl_vllm.routing import HostRoutes
from unirl_vllm.stream import shm_file

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.api import Runtime

EXTENSION = "unirl_vllm.extension.UniRLWorkerExtension"
ENGINE = "vllm"

#: Environment a vLLM host needs; set (unless already set) before vLLM is imported.
DEFAULT_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def _build_llm(llm_kwargs: dict[str, Any]) -> Any:
    """``vllm.LLM(**llm_kwargs)``, with an explicit KV cache size kept.

    Why: vLLM-cpu's platform hook writes ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB, its "legacy setting") over
    ``kv_cache_memory_bytes`` when the variable is set, and UniRL sets it by default (:data:`DEFAULT_ENV`,
    the Makefile). So ``rollout.options.kv_cache_gb`` was silently 1 GiB. While the engine is built (the
    hook runs in the ``LLM`` constructor, in this process) the variable is removed (vLLM cannot parse an
    empty one), then restored for whatever else this process builds."""
    from vllm import LLM

    if "kv_cache_memory_bytes" not in llm_kwargs or not is_cpu_build():
        return LLM(**llm_kwargs)
    saved = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    try:
        return LLM(**llm_kwargs)
    finally:
        if saved is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved


class Host:
    """Owns one ``vllm.LLM``. Plain-data methods only, so it can run as a Ray actor unchanged."""

    def __init__(self, llm_kwargs: dict[str, Any], env: dict[str, str], bucket_bytes: int,
                 runtime: Runtime, model_files: dict[str, bytes] | None = None) -> None:
        for key, value in env.items():
            os.environ.setdefault(key, value)
        llm_kwargs = dict(llm_kwargs)
        self._model_tmp: str | None = None
        if model_files is not None:
            # the driver's model directory is node-local: its files came through Ray's object store
            self._model_tmp = tempfile.mkdtemp(prefix="unirl-engine-model-")
            for rel, data in model_files.items():
                Path(self._model_tmp, rel).parent.mkdir(parents=True, exist_ok=True)
                Path(self._model_tmp, rel).write_bytes(data)
            llm_kwargs["model"] = self._model_tmp
        elif os.path.isabs(str(llm_kwargs.get("model", ""))) and not os.path.isdir(str(llm_kwargs["model"])):
            from unirl.api import describe_node, here

            node = here().node_id
            raise UniRLError(
                f"model.path {llm_kwargs['model']} does not exist on {describe_node(node) if node else 'this node'}, "
                "which hosts a vllm engine replica: put the model on storage every node shares (or use a "
                "Hugging Face id), see docs/cluster.md")
        check_vllm()
        tp = int(llm_kwargs.get("tensor_parallel_size", 1))
        self.thread_binding: str | None = None
        if tp > 1 and is_cpu_build():
            # one worker process per TP rank, its threads bound by the engine (unirl_vllm.binding), from
            # the cores this host may use: vLLM's 'auto' binding fails on a single-NUMA-node machine
            self.thread_binding = os.environ[BIND_ENV] = thread_binding(tp)
        #: a vision-language model (VLLMEngine._llm_kwargs): images ride with requests, and a weight sync
        #: also drops vLLM's cached image embeddings (the tower may have changed)
        self.vision = bool(llm_kwargs.get("limit_mm_per_prompt"))
        if self.vision:
            from unirl_vllm.multimodal import install_processor_shim

            install_processor_shim()
        runtime.install_engine(ENGINE)  # the parity seam: engine-side reference ops, before the model is built
        from vllm import envs

        self.llm = _build_llm(llm_kwargs)
        #: the placeholder id vLLM expands itself: a request's images go with one per image (unirl_vllm.multimodal)
        self.image_token: int | None = None
        self.never: dict[int, float] | None = None  # token ids no request may draw (a VLM's placeholders)
        if self.vision:
            hf_config = self.llm.llm_engine.vllm_config.model_config.hf_config
            self.image_token, self.never = image_token_of(hf_config), placeholder_bias(hf_config)
        self.detokenize = not llm_kwargs.get("skip_tokenizer_init", False)
        # Workers outside this process (engine-core process, or one process per TP rank) get buckets as
        # tmpfs files: raw tensors do not pickle through vLLM's pipes.
        self.multiprocess = bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING) or int(
            llm_kwargs.get("tensor_parallel_size", 1)) > 1
        self.bucket_bytes = bucket_bytes
        pings = self.llm.collective_rpc("unirl_ping")
        self.workers = len(pings)
        self.lora: Any = None  # the LoRARequest every request carries (actor.lora.sync: adapter)
        self.routes: HostRoutes | None = None  # R3's records (record_routing)
        self._lora_dir: str | None = None

    def info(self) -> dict[str, Any]:
        from unirl.api import here

        loc = here()
        return {"workers": self.workers, "multiprocess": self.multiprocess, "detokenize": self.detokenize,
                "node_id": loc.node_id, "pid": loc.pid, "thread_binding": self.thread_binding,
                # the prefix cache serves whole blocks: a request's cached_tokens is a multiple of this
                "block_size": self.llm.llm_engine.vllm_config.cache_config.block_size}

    # ------------------------------------------------------------------ generation, one step at a time
    def start(self, requests: list[dict[str, Any]]) -> list[str]:
        """Add requests to vLLM's engine (none on failure); returns their ids."""
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        added: list[str] = []
        try:
            for r in requests:
                params = VSP(
                    max_tokens=r["max_tokens"], temperature=r["temperature"], top_p=r["top_p"],
                    top_k=r["top_k"], seed=r["seed"], stop_token_ids=list(r["stop_token_ids"]) or None,
                    stop=list(r["stop"]) or None, logprobs=0, detokenize=self.detokenize,
                    ignore_eos=r.get("ignore_eos", False), min_tokens=r.get("min_tokens", 0),
                    output_kind=RequestOutputKind.DELTA, logit_bias=self.never,
                )
                prompt = TokensPrompt(prompt_token_ids=list(r["prompt_ids"]))
                if r.get("images"):  # unirl_vllm.multimodal
                    prompt = TokensPrompt(prompt_token_ids=placeholder_prompt(r["prompt_ids"], self.image_token),
                                          multi_modal_data=r["images"])
                engine.add_request(r["id"], prompt, params, lora_request=self.lora)
                added.append(r["id"])
                if self.routes is not None:
                    self.routes.start(r["id"], len(r["prompt_ids"]))
        except BaseException:
            if added:
                engine.abort_request(added)
            raise
        return added

    def step(self) -> list[dict[str, Any]]:
        """One engine step: the tokens (and log-probs, text) each request gained, finish reasons, and
        ``at_ms``: when this step's outputs existed (:func:`unirl.api.now_ms`, taken here on the host
        right after ``LLMEngine.step()`` returned).

        Why the step and not vLLM's per-request metrics: in 0.32 ``RequestOutput.metrics``
        (``RequestStateStats``) is ``None`` unless stats logging is on, which ``vllm.LLM`` turns off
        (``disable_log_stats=True``) and which would start vLLM's stat loggers; and its token times are
        the engine core's ``time.monotonic()``, not our wall clock. A request's first token and finish
        are the step that delivered them, which is what this engine, stepping vLLM itself, observes."""
        result = []
        outs = self.llm.llm_engine.step()
        at = now_ms()
        if self.routes is not None:  # R3: the workers' records of this step (one rank's: routers are replicated)
            self.routes.add(self.llm.collective_rpc("unirl_routing_take")[0])
        for out in outs:
            c = out.outputs[0]
            ids = [int(t) for t in c.token_ids]
            lps = [float(c.logprobs[i][tok].logprob) for i, tok in enumerate(ids)] if c.logprobs else []
            result.append({"id": out.request_id, "token_ids": ids, "logprobs": lps, "text": c.text or "",
                           "finish_reason": (c.finish_reason or "stop") if out.finished else None, "at_ms": at,
                           "cached_tokens": out.num_cached_tokens, "prompt_len": len(out.prompt_token_ids or ())})
            if self.routes is not None:
                self.routes.gained(out.request_id, len(ids))
                if out.finished:
                    result[-1]["routes"] = self.routes.finish(out.request_id)
        return result

    def record_routing(self) -> dict[str, int]:
        """R3 (``algorithm.routing_replay``): from now on every worker records the expert ids of each fed
        token and :meth:`step` returns a finished request's as ``routes`` (:mod:`unirl_vllm.routing`)."""
        shape = self.llm.collective_rpc("unirl_routing_install")[0]
        self.routes = HostRoutes(shape["layers"], shape["k"])
        return shape

    def abort_requests(self, ids: list[str]) -> None:
        """End requests now (vLLM frees their KV cache); their partial output is what ``step`` gave."""
        if ids:
            self.llm.llm_engine.abort_request(list(ids))
            if self.routes is not None:
                self.routes.forget(list(ids))

    def unfinished(self) -> int:
        """Requests vLLM still holds (0 once every request finished or was aborted)."""
        return int(self.llm.llm_engine.get_num_unfinished_requests())

    # ------------------------------------------------------------------ weight sync
    def sync_begin(self, version: int, kept: list[str] | None = None) -> None:
        """Open one reload session on every worker (:mod:`unirl_vllm.stream` sends the buckets); ``kept``:
        names the sync leaves out on purpose (held unchanged)."""
        self.llm.collective_rpc("unirl_sync_begin", kwargs={"version": version, "kept": list(kept or [])})

    def sync_load(self, bucket: list[tuple[str, torch.Tensor]] | str) -> int:
        """Load one bucket on every worker: tensors, or a safetensors file on this node's tmpfs (``shm``)."""
        if isinstance(bucket, str):  # workers read the file
            return self.llm.collective_rpc("unirl_sync_load", kwargs={"path": bucket})[0]
        if self.multiprocess:
            # Raw tensors do not pickle through the engine-core pipe ("cannot pickle memoryview");
            # a safetensors file on tmpfs does, at the cost of one copy.
            with shm_file(bucket) as path:
                return self.llm.collective_rpc("unirl_sync_load", kwargs={"path": path})[0]
        return self.llm.collective_rpc("unirl_sync_load", kwargs={"weights": bucket})[0]

    def sync_finish(self, transport: str) -> list[dict[str, Any]]:
        """Close the session on every worker; their receipts, each naming the transport and this node."""
        from unirl.api import here

        receipts = self.llm.collective_rpc("unirl_sync_finish")
        if not self.llm.reset_prefix_cache():
            raise WeightSyncError("vLLM refused to reset its prefix cache (requests still running?)")
        if self.vision:  # image embeddings computed with the old tower must not be served again
            self.llm.llm_engine.reset_encoder_cache()
        node = here().node_id
        return [{**r, "transport": transport, "node": node} for r in receipts]

    def load_adapter(self, version: int, files: dict[str, bytes]) -> dict[str, Any]:
        """Serve the peft adapter whose files are ``files`` as ``version``: written to a directory of this
        host (so a Ray replica on another node gets it too), added to vLLM under a new LoRA id, the
        previous one removed. Every request started afterwards carries it (:meth:`start`). On failure the
        previous adapter keeps serving. Returns the receipt's fields: the fingerprint of the written
        adapter tensors (:func:`unirl.api.adapter_fingerprint`)."""
        import shutil

        from vllm.lora.request import LoRARequest

        from unirl.api import here

        t0 = time.perf_counter()
        lora_id = version + 1  # vLLM's LoRA ids are positive ints; one per version, so none is reused
        path = tempfile.mkdtemp(prefix=f"unirl-adapter-v{version}-")
        try:
            for rel, data in files.items():
                Path(path, rel).write_bytes(data)
            request = LoRARequest(f"unirl-v{version}", lora_id, path)
            if self.lora is not None and self.lora.lora_int_id == lora_id:
                self.llm.llm_engine.remove_lora(lora_id)  # the same version again (a retried sync)
            if not self.llm.llm_engine.add_lora(request):
                raise WeightSyncError(f"vLLM refused LoRA adapter of version {version}")
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        old, old_dir = self.lora, self._lora_dir
        self.lora, self._lora_dir = request, path
        if old is not None and old.lora_int_id != lora_id:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)
        if not self.llm.reset_prefix_cache():
            raise WeightSyncError("vLLM refused to reset its prefix cache (requests still running?)")
        from safetensors import safe_open

        with safe_open(str(Path(path, ADAPTER_WEIGHTS)), "pt") as f:
            count = len(list(f.keys()))
        return {"version": version, "fingerprint": adapter_fingerprint(path), "num_tensors": count,
                "seconds": time.perf_counter() - t0, "node": here().node_id}

    def sync_abort(self) -> list[bool]:
        try:
            return self.llm.collective_rpc("unirl_sync_abort")
        except Exception:  # noqa: BLE001 - best effort; the caller reloads the committed weights
            return [False]

    def close(self) -> None:
        """Shut the engine down and release the distributed state, so a new engine can start here."""
        llm = getattr(self, "llm", None)
        self.llm = None
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        try:
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        except Exception:  # noqa: BLE001 - closing must not raise
            pass
        del llm, core
        if getattr(self, "_lora_dir", None):
            import shutil

            shutil.rmtree(str(self._lora_dir), ignore_errors=True)
        if self._model_tmp is not None:
            import shutil

            shutil.rmtree(self._model_tmp, ignore_errors=True)
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except Exception:  # noqa: BLE001
            import gc

            gc.collect()
