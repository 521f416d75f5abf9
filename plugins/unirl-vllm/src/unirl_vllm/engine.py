"""The ``vllm`` rollout engine: vLLM's offline ``LLMEngine`` in the trainer's process or in Ray actors.

With a Ray placement, ``rollout.options.replicas`` hosts sit behind the one engine: a batch is spread
over them by load and stepped on all at once, and a weight sync reaches every replica (carrier chosen
per replica by :mod:`unirl.sync.transport`) and is served only when every receipt matches.

Two layers:

* :class:`_Host` owns one ``vllm.LLM`` and speaks plain data (token ids, floats, dicts): ``start``
  adds requests, ``step`` runs one engine step and returns the new tokens of each request,
  ``abort_requests`` ends requests mid-generation. The same class runs in-process or as a Ray actor;
* :class:`VLLMEngine` is the :class:`unirl.contracts.RolloutEngine` the trainer sees, built on
  :class:`unirl.engine.queued.QueuedEngine` (submit / poll / abort / pause / resume): its
  :meth:`VLLMEngine._run` drives the host step by step, so an ``abort`` stops a generation at the next
  step and keeps the partial tokens. It continues a sample from its whole context
  (``prompt_ids + response_ids``), stamps the served weight version on every token, stages and
  validates weight syncs with :mod:`unirl.weights` before anything reaches vLLM, refuses a sync while
  requests are in flight, and serves a new version only when every worker's receipt matches
  (:func:`unirl.contracts.verify_receipts`); otherwise it puts the previous weights back. The
  trainer's ledger is the only ledger.

Where the engine's first weights come from: vLLM must start from a directory. ``model.path`` is used
when set; otherwise the adapter builds the model (seeded, so it equals the actor's initial weights)
and it is saved with its tokenizer to ``<run_dir>/engine_init``. Either way the trainer publishes the
actor's weights before the first rollout, so the directory only has to have the right architecture.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unirl.api import (
    ADAPTER_WEIGHTS,
    Fingerprint,
    Handle,
    QueuedEngine,
    Receipt,
    Sample,
    SampleError,
    SamplingParams,
    Staged,
    UniRLError,
    WeightSpec,
    WeightSyncError,
    WorkerLostError,
    adapter_fingerprint,
    connect_ray,
    engine_init_dir,
    now_ms,
    trim_after_transient,
    verify_receipts,
    weight_buckets,
)
from unirl_vllm.binding import BIND_ENV, thread_binding
from unirl_vllm.capabilities import vllm_capabilities
from unirl_vllm.committed import CommittedCopy
from unirl_vllm.compat import check_vllm, is_cpu_build
from unirl_vllm.memory_layout import vllm_layout
from unirl_vllm.options import VLLMOptions
from unirl_vllm.stream import shm_file

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.api import ModelAdapter, RunConfig, Runtime

EXTENSION = "unirl_vllm.extension.UniRLWorkerExtension"
ENGINE = "vllm"

#: the values vLLM 0.32 accepts for ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

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


class _Host:
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
        runtime.install_engine(ENGINE)  # the parity seam: engine-side reference ops, before the model is built
        from vllm import envs

        self.llm = _build_llm(llm_kwargs)
        self.detokenize = not llm_kwargs.get("skip_tokenizer_init", False)
        # Workers outside this process (engine-core process, or one process per TP rank) get buckets as
        # tmpfs files: raw tensors do not pickle through vLLM's pipes.
        self.multiprocess = bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING) or int(
            llm_kwargs.get("tensor_parallel_size", 1)) > 1
        self.bucket_bytes = bucket_bytes
        pings = self.llm.collective_rpc("unirl_ping")
        self.workers = len(pings)
        self.lora: Any = None  # the LoRARequest every request carries (actor.lora.sync: adapter)
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
                    output_kind=RequestOutputKind.DELTA,
                )
                engine.add_request(r["id"], TokensPrompt(prompt_token_ids=list(r["prompt_ids"])), params,
                                   lora_request=self.lora)
                added.append(r["id"])
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
        for out in outs:
            c = out.outputs[0]
            ids = [int(t) for t in c.token_ids]
            lps = [float(c.logprobs[i][tok].logprob) for i, tok in enumerate(ids)] if c.logprobs else []
            result.append({"id": out.request_id, "token_ids": ids, "logprobs": lps, "text": c.text or "",
                           "finish_reason": (c.finish_reason or "stop") if out.finished else None, "at_ms": at,
                           "cached_tokens": out.num_cached_tokens})
        return result

    def abort_requests(self, ids: list[str]) -> None:
        """End requests now (vLLM frees their KV cache); their partial output is what ``step`` gave."""
        if ids:
            self.llm.llm_engine.abort_request(list(ids))

    def unfinished(self) -> int:
        """Requests vLLM still holds (0 once every request finished or was aborted)."""
        return int(self.llm.llm_engine.get_num_unfinished_requests())

    # ------------------------------------------------------------------ weight sync
    def sync_begin(self, version: int) -> None:
        """Open one reload session on every worker (:mod:`unirl_vllm.stream` sends the buckets)."""
        self.llm.collective_rpc("unirl_sync_begin", kwargs={"version": version})

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


def _drain(source: Iterator[Any]) -> None:
    """Consume what is left of a failed sync's source: an FSDP actor's stream is a collective that every
    rank must finish (abandoned, its group is stopped). A source that itself failed ends at once."""
    try:
        for _ in source:
            pass
    except Exception:  # noqa: BLE001 - the sync's own failure is what is reported
        pass


class EngineReplicaLost(WorkerLostError, RuntimeError):
    """A vLLM replica's Ray actor died (its process, or its whole node): named with the node."""


class ReplicaLostInSync(WeightSyncError, EngineReplicaLost):
    """A replica died during a weight sync: the ledger keeps the old version (a sync failure), and the
    run may restart from its last checkpoint (a lost worker: ``run.max_restarts``)."""


class _RayHost:
    """A :class:`_Host` inside one Ray actor (one replica); same methods, blocking, plus :meth:`remote`."""

    def __init__(self, llm_kwargs: dict[str, Any], env: dict[str, str], bucket_bytes: int, num_cpus: float,
                 runtime: Runtime, *, index: int = 0, scheduling: Any = None,
                 model_files: Any = None) -> None:
        import ray

        connect_ray(log_to_driver=False)
        actor_cls = ray.remote(_Host)
        self._ray = ray
        self.index = index
        self.info_: dict[str, Any] = {}
        opts: dict[str, Any] = {"num_cpus": num_cpus, "runtime_env": {"env_vars": env}, "max_restarts": 0}
        if scheduling is not None:
            opts["scheduling_strategy"] = scheduling
        self._actor = actor_cls.options(**opts).remote(llm_kwargs, env, bucket_bytes, runtime, model_files)

    def remote(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Start ``name`` on the replica; the object ref (resolve it with :meth:`result`)."""
        return getattr(self._actor, name).remote(*args, **kwargs)

    def result(self, ref: Any, what: str) -> Any:
        """``ray.get(ref)``; a dead replica raises :class:`EngineReplicaLost` naming it and its node."""
        import ray.exceptions as rex

        try:
            return self._ray.get(ref)
        except (rex.RayActorError, rex.ActorUnavailableError) as exc:
            raise EngineReplicaLost(f"vllm replica {self.index} {self.where()} was lost during {what}: "
                                    f"{_death_cause(exc)}. Restart from the latest checkpoint (run.resume=true), "
                                    "or set run.max_restarts to let the trainer do it") from exc

    def where(self) -> str:
        node = self.info_.get("node_id")
        if node is None:
            return "(not started)"
        try:
            from unirl.api import describe_node

            return f"on {describe_node(node)}"
        except Exception:  # noqa: BLE001 - the GCS may be unreachable while a cluster falls apart
            return f"on node {node[:8]}"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.result(self.remote(name, *args, **kwargs), name)

        return call

    def close(self) -> None:
        try:
            self._ray.get(self._actor.close.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - a dead replica has nothing left to close
            pass
        finally:
            self._ray.kill(self._actor)


def _death_cause(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    node_lines = [ln for ln in lines if "node" in ln and "died" in ln]
    return " | ".join(node_lines or lines[:2])


def _model_files(model_dir: str) -> dict[str, bytes]:
    """Every file of a (small, driver-built) model directory, to ship through Ray's object store."""
    root = Path(model_dir)
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


@dataclass
class _Pending:
    """One request in flight in :meth:`VLLMEngine._run`: what vLLM returned for it so far."""

    sample: Sample
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""


class VLLMEngine(QueuedEngine):
    """vLLM as a UniRL rollout engine, with transactional in-place weight sync (see the module doc)."""

    name = ENGINE
    Config = VLLMOptions
    memory_layout = classmethod(vllm_layout)  # the memory plan's declaration (unirl_vllm.memory_layout)

    capabilities = classmethod(vllm_capabilities)  # pairings and layout (unirl_vllm.capabilities)

    def __init__(self, *, config: RunConfig, adapter: ModelAdapter, runtime: Runtime, options: VLLMOptions,
                 tokenizer: Any = None) -> None:
        """``options``: ``rollout.options`` as the kernel validated it (build with ``Kernel.build``, or
        ``unirl.api.build_engine`` in a test, so options written into ``config`` are not ignored)."""
        super().__init__()
        self.options = options
        self.config = config
        self.adapter = adapter
        self.tokenizer = tokenizer
        self.runtime = runtime
        self._broken: str | None = None
        self._cached = 0  # tokens put into vLLM's prefix cache since its last reset (see cache_tokens)
        self._request_ids = itertools.count()
        self.model_dir, self.tokenizer = engine_init_dir(config, adapter, self.tokenizer)
        self.dtype = f"torch.{config.model.dtype}"
        self.spec = WeightSpec.from_checkpoint(self.model_dir, self.dtype)
        self.llm_kwargs = self._llm_kwargs()
        # every plugin's unirl_worker_env (e.g. parity flags) must reach the process that hosts vLLM
        env = {**DEFAULT_ENV, **runtime.worker_env}
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.bucket_bytes = int(options.bucket_mb * 2**20)
        # where a failed sync finds the last committed weights (the start-up checkpoint until a commit)
        self._copy = CommittedCopy(self.model_dir, self.dtype,
                                   None if options.keep_committed_copy else Path(config.run_dir) / "engine_committed")
        self._pg: Any = None
        self._hosts: list[Any] = []
        t0 = time.perf_counter()
        try:
            if self.options.on_ray:
                self._start_replicas(env, runtime)
            else:
                self._hosts = [_Host(self.llm_kwargs, env, self.bucket_bytes, runtime)]
        except BaseException:
            self.close()
            raise
        self.startup_seconds = time.perf_counter() - t0
        self.host_info: dict[str, Any] = self._hosts[0].info() if not self.options.on_ray else self._hosts[0].info_

    @property
    def _host(self) -> Any:
        """The first (or only) replica."""
        return self._hosts[0] if self._hosts else None

    @property
    def replicas(self) -> list[dict[str, Any]]:
        """Each replica's ``info`` (workers, node_id, pid)."""
        return [h.info_ if isinstance(h, _RayHost) else h.info() for h in self._hosts]

    def _start_replicas(self, env: dict[str, str], runtime: Runtime) -> None:
        """``replicas`` Ray actors in one placement group (``rollout.options.placement``), started at once.

        A model directory the driver built (``engine_init``) is node-local: its files travel with the
        actors through Ray's object store. A ``model.path`` must be on storage every node shares."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        connect_ray(log_to_driver=False)  # RAY_ADDRESS (if set) joins a cluster, else a local Ray starts
        o = self.options
        self._pg = o.ray_placement.placement_group(
            o.replicas, {"CPU": o.ray_num_cpus}, field="rollout.options.placement", timeout_s=180.0)
        files = None if self.config.model.path else ray.put(_model_files(self.model_dir))
        for i in range(o.replicas):
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i)
            self._hosts.append(_RayHost(self.llm_kwargs, env, self.bucket_bytes, o.ray_num_cpus, runtime,
                                        index=i, scheduling=strategy, model_files=files))
        refs = [h.remote("info") for h in self._hosts]
        for h, ref in zip(self._hosts, refs, strict=True):
            h.info_ = h.result(ref, "start-up")

    # ------------------------------------------------------------------ set-up
    def _eos_ids(self) -> set[int]:
        """The eos ids of the served model (its config and generation config) and of the tokenizer."""
        ids: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            f = Path(self.model_dir, name)
            v = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
            ids.update([v] if isinstance(v, int) else list(v or []))
        v = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(v, int):
            ids.add(v)
        return ids

    def _llm_kwargs(self) -> dict[str, Any]:
        o = self.options
        skip_tok = o.skip_tokenizer_init
        if skip_tok is None:
            skip_tok = not any(Path(self.model_dir, f).is_file() for f in ("tokenizer.json", "tokenizer.model"))
        kwargs: dict[str, Any] = dict(
            model=self.model_dir,
            skip_tokenizer_init=skip_tok,
            dtype=self.config.model.dtype,
            seed=self.config.run.seed if o.seed is None else o.seed,
            enforce_eager=o.enforce_eager,
            logprobs_mode=o.logprobs_mode,
            enable_prefix_caching=o.enable_prefix_caching,
            tensor_parallel_size=o.tensor_parallel_size,
            worker_extension_cls=EXTENSION,
        )
        if o.tensor_parallel_size > 1 and is_cpu_build():
            kwargs["distributed_executor_backend"] = "mp"  # one process per rank (unirl_vllm.binding)
        if o.kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(o.kv_cache_gb * (1 << 30))
        if o.max_model_len is not None:
            kwargs["max_model_len"] = o.max_model_len
        if not is_cpu_build():  # on the CPU this knob sizes a memory check, not the KV cache
            kwargs["gpu_memory_utilization"] = o.gpu_memory_utilization
        lora = self.config.actor.lora
        if lora is not None and lora.sync == "adapter":  # vLLM serves the adapter (load_adapter)
            ranks = [r for r in LORA_RANKS if r >= lora.r]
            if not ranks:
                raise UniRLError(f"actor.lora.r {lora.r}: vLLM serves LoRA ranks up to {LORA_RANKS[-1]} (fix: a "
                                 "smaller r, or actor.lora.sync: merged)")
            kwargs.update(enable_lora=True, max_lora_rank=ranks[0], max_loras=1)
        kwargs.update(self.adapter.engine_args(ENGINE, self.config))
        kwargs.update(o.engine_args)
        return kwargs

    def engine_weight_name(self, name: str) -> str:
        """The actor's parameter name as this engine's checkpoint names it (the adapter decides)."""
        return self.adapter.engine_weight_name(name, ENGINE)

    def engine_weights(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """One actor tensor as this engine's checkpoint holds it (renamed; fused MoE experts split)."""
        return self.adapter.engine_weights(name, tensor, ENGINE)

    def cache_tokens(self) -> int:
        """An upper bound on the tokens in vLLM's prefix cache: every context and output token served
        since the last reset (each weight sync resets it, :meth:`_Host.sync`); vLLM may have evicted
        some. 0 without prefix caching. The trace records it as "warm, at most N tokens"."""
        return self._cached if self.options.enable_prefix_caching else 0

    # ------------------------------------------------------------------ generation
    def submit(self, samples: list[Sample], sampling: SamplingParams) -> Handle:
        if self._broken:
            raise WeightSyncError(f"engine is unusable after a failed recovery: {self._broken}")
        if sampling.stop and not self.host_info["detokenize"]:
            raise SampleError("stop strings need a tokenizer in the engine's model directory (skip_tokenizer_init "
                              "is on); use stop token ids instead")
        return super().submit(samples, sampling)

    def _assign(self, costs: list[int]) -> list[int]:
        """Replica of each request, spreading load: longest first, each to the least-loaded replica
        (load = prompt + token budget already assigned in this batch)."""
        load = [0] * len(self._hosts)
        out = [0] * len(costs)
        for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
            r = min(range(len(load)), key=lambda r: (load[r], r))
            out[i] = r
            load[r] += costs[i]
        return out

    def _call_all(self, calls: list[tuple[int, str, tuple]]) -> list[Any]:
        """Run ``(replica, method, args)`` calls; Ray replicas all at once, results in order."""
        hosts = self._hosts
        if not isinstance(hosts[0], _RayHost):
            return [getattr(hosts[r], m)(*a) for r, m, a in calls]
        refs = [hosts[r].remote(m, *a) for r, m, a in calls]
        return [hosts[r].result(ref, m) for (r, m, _), ref in zip(calls, refs, strict=True)]

    def _run(self, samples: list[Sample], sampling: SamplingParams, should_stop: Callable[[], bool],
             version: int) -> None:
        """Drive vLLM step by step (every replica at once); on ``should_stop()`` abort what is left and
        keep its partial turn."""
        live: list[dict[str, _Pending]] = [{} for _ in self._hosts]
        requests: list[dict[str, Any]] = []
        ignore_eos = sampling.ignore_eos or self.options.ignore_eos
        # vLLM stops at a listed stop id even with ignore_eos: the eos ids the trainer lists go too
        eos = self._eos_ids() if ignore_eos else set()
        stop_ids = tuple(i for i in sampling.stop_token_ids if i not in eos)
        for s in samples:
            limit = sampling.new_token_limit(s)
            if limit <= 0:  # the response budget is spent: an empty turn, no vLLM request
                self._finish_turn(_Pending(s), "length", sampling, version)
                continue
            rid = f"{s.id}#{s.turns}#{next(self._request_ids)}"
            requests.append({
                "id": rid, "prompt_ids": s.context_ids, "max_tokens": limit,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                "seed": s.turn_seed(), "stop_token_ids": stop_ids, "stop": sampling.stop,
                "ignore_eos": ignore_eos, "min_tokens": min(sampling.min_new_tokens, limit),
                "_sample": s,
            })
        if not requests:
            return
        if should_stop():
            for r in requests:
                self._finish_turn(_Pending(r["_sample"]), "abort", sampling, version)
            return
        where = self._assign([len(r["prompt_ids"]) + r["max_tokens"] for r in requests])
        per_host: list[list[dict[str, Any]]] = [[] for _ in self._hosts]
        for r, h in zip(requests, where, strict=True):
            s = r.pop("_sample")
            live[h][r["id"]] = _Pending(s)
            if len(self._hosts) > 1:
                s.requests[-1].worker = str(h)
            per_host[h].append(r)
        busy = [h for h in range(len(self._hosts)) if per_host[h]]
        self._call_all([(h, "start", (per_host[h],)) for h in busy])
        try:
            while any(live):
                if should_stop():
                    self._call_all([(h, "abort_requests", (list(live[h]),)) for h in busy if live[h]])
                    for part in live:
                        for p in part.values():
                            self._finish_turn(p, "abort", sampling, version)
                        part.clear()
                    break
                active = [h for h in busy if live[h]]
                outs = self._call_all([(h, "step", ()) for h in active])
                t = now_ms()
                for h, host_outs in zip(active, outs, strict=True):
                    part = live[h]
                    for out in host_outs:
                        p = part.get(out["id"])
                        if p is None:
                            continue
                        rec = p.sample.requests[-1]
                        at = out.get("at_ms") or t  # the host's step time (see _Host.step)
                        if out["token_ids"] and not rec.first_token_ms:
                            rec.first_token_ms = at
                        if out["finish_reason"] is not None:
                            rec.finished_ms = at  # this request's own finishing step, not the job's end
                            if out.get("cached_tokens") is not None:
                                rec.cached_tokens = int(out["cached_tokens"])
                        p.token_ids.extend(out["token_ids"])
                        p.logprobs.extend(out["logprobs"])
                        p.text += out["text"]
                        if out["finish_reason"] is not None:
                            self._cached += len(p.sample.context_ids) + len(p.token_ids)
                            del part[out["id"]]
                            self._finish_turn(p, out["finish_reason"], sampling, version)
                    if part and not host_outs and not self._call_all([(h, "unfinished", ())])[0]:
                        raise RuntimeError(f"vLLM replica {h} dropped {len(part)} request(s) without finishing "
                                           f"them: {sorted(part)[:3]}")
        except BaseException:
            for h in busy:
                if live[h]:
                    try:
                        self._call_all([(h, "abort_requests", (list(live[h]),))])
                    except Exception:  # noqa: BLE001 - the original error is what matters
                        pass
            raise

    def _finish_turn(self, p: _Pending, reason: str, sampling: SamplingParams, version: int) -> None:
        s, ids = p.sample, p.token_ids
        if sampling.logprobs:
            if len(p.logprobs) != len(ids):
                raise SampleError(f"sample {s.id} from vllm: {len(ids)} tokens but {len(p.logprobs)} log-probs")
            lps = p.logprobs
        else:
            lps = [0.0] * len(ids)
        text = p.text
        if not text and ids and self.tokenizer is not None and not self.host_info["detokenize"]:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        s.append_model_turn(ids, lps, version, reason, text=text)
        s.meta["engine"] = ENGINE
        s.meta["logprobs_mode"] = self.options.logprobs_mode

    # ------------------------------------------------------------------ weight sync
    def stage(self) -> Staged:
        """An empty staging area for one sync: names mapped through the adapter, checked as they arrive."""
        return Staged(spec=self.spec, expand=self.engine_weights)

    def load_weights(self, staged: Staged | Iterable[tuple[str, torch.Tensor]], version: int) -> list[Receipt]:
        """Load a set in one session; serve ``version`` only if every receipt matches.

        A plain ``(name, tensor)`` iterable (actor names, mapped through the adapter) is streamed into vLLM
        bucket by bucket as it is checked (:meth:`load_stream`); a :class:`~unirl.api.Staged` set (engine
        names) is streamed from what it holds. On any failure the previous weights serve again and this
        raises :class:`~unirl.kernel.errors.WeightSyncError` (:class:`~unirl.kernel.errors.SyncRefusedError`
        while requests are in flight)."""
        if isinstance(staged, Staged):
            staged.finish()  # a set staged elsewhere is refused whole, before anything reaches vLLM
            staged.closed = True
            return self.load_stream(staged.tensors, version, engine_names=True)[0]
        return self.load_stream(staged, version)[0]

    def load_stream(self, named: Iterable[tuple[str, torch.Tensor]], version: int, *,
                    engine_names: bool = False) -> tuple[list[Receipt], str]:
        """Stream ``named`` into every replica in one session of ``rollout.options.bucket_mb`` buckets
        (:mod:`unirl_vllm.stream`); returns the receipts and the sender's fingerprint of what was sent.

        Each tensor is renamed (unless ``engine_names``), checked and copied as it arrives, so the
        trainer's process holds about two buckets, not the model. A bad tensor found after earlier
        buckets were loaded, a receipt that does not match, or a failed load puts the last committed
        version back (:mod:`unirl_vllm.committed`) and raises."""
        from unirl_vllm.stream import SyncSession, checked

        with self.quiesced(version):
            if self._broken:
                raise WeightSyncError(f"engine is unusable after a failed recovery: {self._broken}")
            staged = Staged(spec=self.spec, expand=None if engine_names else self.engine_weights, keep=False)
            sent = Fingerprint()
            session = SyncSession(self._hosts, self.transports(), int(version), ray=self.options.on_ray)
            copy = self._copy.writer()
            source = iter(named)
            try:
                for bucket in weight_buckets(checked(staged, source, sent), self.bucket_bytes):
                    session.load(bucket)
                    copy.add(bucket)
                    del bucket  # the next bucket is built while nothing holds this one
                    self._give_back()
                staged.finish()
                raw = session.finish()
            except Exception as exc:
                copy.discard()
                _drain(source)
                raise self._failed(session, int(version), exc) from exc
            self._cached = 0  # every replica reset its prefix cache after loading (_Host.sync_finish)
            receipts = [Receipt(**r) for r in raw]
            try:
                verify_receipts(int(version), receipts, sent.hexdigest())
            except WeightSyncError as exc:
                copy.discard()
                self._recover(str(exc))
                raise WeightSyncError(f"{exc}; the engine serves version {self.weight_version} again") from exc
            self._copy.commit(copy, sent.hexdigest())
            self._set_version(int(version))
            return receipts, sent.hexdigest()

    def load_adapter(self, path: str, version: int) -> list[Receipt]:
        """Serve the peft adapter directory ``path`` on every replica as ``version`` (``actor.lora.sync:
        adapter``); one receipt per replica, fingerprinting the adapter tensors that replica wrote. Its
        files travel as bytes in the call (an adapter is small), so a replica on another node gets them."""
        with self.quiesced(version):
            if self._broken:
                raise WeightSyncError(f"engine is unusable after a failed recovery: {self._broken}")
            files = {name: Path(path, name).read_bytes() for name in ("adapter_config.json", ADAPTER_WEIGHTS)}
            expected = adapter_fingerprint(path)
            transports = self.transports()
            try:
                raw = self._call_all([(i, "load_adapter", (int(version), files)) for i in range(len(self._hosts))])
            except Exception as exc:
                raise WeightSyncError(f"loading the LoRA adapter of version {version} failed ({exc}); a replica "
                                      "that had not loaded it serves its previous adapter") from exc
            self._cached = 0
            receipts = [Receipt(worker=i, transport="inprocess" if t == "inprocess" else "object_store", **r)
                        for i, (r, t) in enumerate(zip(raw, transports, strict=True))]
            verify_receipts(int(version), receipts, expected)
            self._set_version(int(version))
            return receipts

    def _give_back(self) -> None:
        """Hand the heap's free pages back to the kernel after each bucket (glibc ``malloc_trim``).

        Why: the live memory a sync adds is about one bucket, but each bucket's copies and vLLM's per-layer
        buffers are freed between the long-lived re-packed weights, and glibc keeps those holes: measured
        at 145 MB of weights in 8 MB buckets, RSS grew by 90-130 MB during a sync with 10 MB live, and by
        about 37 MB when trimmed after each bucket. Not under ``run.allocator: retain``, whose point is to
        keep freed pages for the next step's buffers."""
        trim_after_transient(self.config.run.allocator)

    def _failed(self, session: Any, version: int, exc: Exception) -> WeightSyncError:
        """The error for a sync that failed mid-stream, after the last committed weights were put back
        (only when a replica had been touched: a payload refused in its first bucket never reached vLLM)."""
        if session.begun:
            self._recover(f"loading version {version} failed: {type(exc).__name__}: {exc}", session.abort)
        served = f"the engine serves version {self.weight_version} again"
        if isinstance(exc, EngineReplicaLost):
            return ReplicaLostInSync(f"weight sync to version {version} failed while loading ({exc}); {served}")
        if isinstance(exc, WeightSyncError):  # the payload's own fault (checked here or by a worker)
            return WeightSyncError(f"{exc}; {served}")
        return WeightSyncError(f"weight sync to version {version} failed while loading ({exc}); {served}")

    def _recover(self, why: str, abort: Callable[[], None] | None = None) -> None:
        """Put the last committed weights back (:mod:`unirl_vllm.committed`), streamed like a sync and
        checked by its receipts when the copy's fingerprint is known; marks the engine broken on failure."""
        from unirl_vllm.stream import SyncSession

        try:
            if abort is not None:
                abort()
            else:
                self._call_all([(h, "sync_abort", ()) for h in range(len(self._hosts))])
            session = SyncSession(self._hosts, self.transports(), self.weight_version, ray=self.options.on_ray)
            for bucket in self._copy.buckets(self.bucket_bytes):
                session.load(bucket)
                del bucket
                self._give_back()
            raw = session.finish()
            self._cached = 0
            if self._copy.fingerprint is not None:
                verify_receipts(self.weight_version, [Receipt(**r) for r in raw], self._copy.fingerprint)
        except Exception as exc:  # noqa: BLE001 - report both failures
            self._broken = f"{why}; then restoring version {self.weight_version} failed: {exc}"

    def transports(self) -> list[str]:
        """The weight transport to each replica, chosen by where it is (:mod:`unirl.sync.transport`)."""
        from unirl.api import Location, choose_transport, here

        me = here()
        out = []
        for h in self._hosts:
            info = h.info_ if isinstance(h, _RayHost) else None
            out.append("inprocess" if info is None else choose_transport(me, Location(info["node_id"], info["pid"])))
        return out

    def close(self) -> None:
        super().close()
        copy = getattr(self, "_copy", None)
        if copy is not None:
            copy.close()
        hosts, self._hosts = list(getattr(self, "_hosts", [])), []
        for host in hosts:
            host.close()
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - Ray already gone
                pass
