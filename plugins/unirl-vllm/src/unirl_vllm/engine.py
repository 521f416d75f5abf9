"""The ``vllm`` rollout engine: vLLM's offline ``LLMEngine`` in the trainer's process or in Ray actors.

With a Ray placement, ``rollout.options.replicas`` hosts sit behind the one engine: a batch is spread
over them by load and stepped on all at once, and a weight sync reaches every replica (carrier chosen
per replica by :mod:`unirl.sync.transport`) and is served only when every receipt matches.

Layers, each in its own module:

* :class:`unirl_vllm.host.Host` owns one ``vllm.LLM`` and speaks plain data (token ids, floats,
  dicts): ``start`` adds requests, ``step`` runs one engine step and returns the new tokens of each request,
  ``abort_requests`` ends requests mid-generation. The same class runs in-process or as a Ray actor
  (:mod:`unirl_vllm.replicas`: ``RayHost``, calls to every replica at once, the weight transport to each);
* :mod:`unirl_vllm.generation` keeps one submission's requests in flight: building them, dispatching
  them to the replicas, absorbing each step's outputs, aborting;
* :class:`VLLMEngine` is the :class:`unirl.contracts.RolloutEngine` the trainer sees, built on
  :class:`unirl.engine.queued.QueuedEngine` (submit / poll / abort / pause / resume): its
  :meth:`VLLMEngine._run` drives the hosts step by step, so an ``abort`` stops a generation at the next
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
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
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
    adapter_fingerprint,
    attach_routes,
    connect_ray,
    engine_init_dir,
    trim_after_transient,
    verify_receipts,
    weight_buckets,
)
from unirl_vllm.capabilities import vllm_capabilities
from unirl_vllm.committed import CommittedCopy
from unirl_vllm.compat import is_cpu_build
from unirl_vllm.generation import Generation, Pending, assign, build_requests
from unirl_vllm.host import DEFAULT_ENV, ENGINE, EXTENSION, Host
from unirl_vllm.memory_layout import vllm_layout
from unirl_vllm.multimodal import image_engine_args
from unirl_vllm.options import VLLMOptions
from unirl_vllm.replicas import (
    EngineReplicaLost,
    RayHost,
    ReplicaLostInSync,
    call_all,
    model_files,
    transports,
)
from unirl_vllm.routing import unrecorded

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.api import ModelAdapter, RunConfig, Runtime

__all__ = ["DEFAULT_ENV", "ENGINE", "EXTENSION", "LORA_RANKS", "EngineReplicaLost", "ReplicaLostInSync",
           "VLLMEngine"]

#: the values vLLM 0.32 accepts for ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _drain(source: Iterator[Any]) -> None:
    """Consume what is left of a failed sync's source: an FSDP actor's stream is a collective that every
    rank must finish (abandoned, its group is stopped). A source that itself failed ends at once."""
    try:
        for _ in source:
            pass
    except Exception:  # noqa: BLE001 - the sync's own failure is what is reported
        pass



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
                self._hosts = [Host(self.llm_kwargs, env, self.bucket_bytes, runtime)]
            #: R3 (algorithm.routing_replay): the workers record each fed token's expert ids (unirl_vllm.routing)
            self._routes: dict[str, int] | None = None
            if config.algorithm.routing_replay:
                self._routes = self._call_all([(h, "record_routing", ()) for h in range(len(self._hosts))])[0]
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
        return [h.info_ if isinstance(h, RayHost) else h.info() for h in self._hosts]

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
        files = None if self.config.model.path else ray.put(model_files(self.model_dir))
        for i in range(o.replicas):
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i)
            self._hosts.append(RayHost(self.llm_kwargs, env, self.bucket_bytes, o.ray_num_cpus, runtime,
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
        if self.adapter.vision:  # images ride with the prompts (unirl_vllm.multimodal)
            kwargs.update(image_engine_args())
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
        since the last reset (each weight sync resets it, :meth:`~unirl_vllm.host.Host.sync_finish`); vLLM
        may have evicted some. 0 without prefix caching. The trace records it as "warm, at most N tokens"."""
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
        """Replica of each request, spreading load (:func:`unirl_vllm.generation.assign`)."""
        return assign(costs, len(self._hosts))

    def _call_all(self, calls: list[tuple[int, str, tuple]]) -> list[Any]:
        """Run ``(replica, method, args)`` calls (:func:`unirl_vllm.replicas.call_all`)."""
        return call_all(self._hosts, calls)

    def _run(self, samples: list[Sample], sampling: SamplingParams, should_stop: Callable[[], bool],
             version: int) -> None:
        """Drive vLLM step by step (every replica at once); on ``should_stop()`` abort what is left and
        keep its partial turn. The steps are :mod:`unirl_vllm.generation`'s: build the requests,
        dispatch them, absorb each step's outputs, abort."""
        def finish(p: Pending, reason: str) -> None:
            self._finish_turn(p, reason, sampling, version)

        ignore_eos = sampling.ignore_eos or self.options.ignore_eos
        requests, spent = build_requests(samples, sampling, ignore_eos=ignore_eos, eos_ids=self._eos_ids,
                                         ids=self._request_ids)
        for s in spent:  # the response budget is spent: an empty turn, no vLLM request
            finish(Pending(s), "length")
        if not requests:
            return
        if should_stop():
            for r in requests:
                finish(Pending(r["_sample"]), "abort")
            return
        gen = Generation(self._hosts, self._call_all, finish, self._served)
        gen.dispatch(requests)
        try:
            while gen:
                if should_stop():
                    gen.abort()
                    break
                gen.step()
        except BaseException as exc:
            gen.abort_after_failure(exc)
            raise

    def _served(self, tokens: int) -> None:
        """Count a finished request's context and output into the prefix cache's bound
        (:meth:`cache_tokens`)."""
        self._cached += tokens

    def _finish_turn(self, p: Pending, reason: str, sampling: SamplingParams, version: int) -> None:
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
        if self._routes is not None:  # an aborted request's partial turn has no records: -1 (the trainer routes)
            attach_routes(s, p.routes if p.routes is not None else unrecorded(len(ids), self._routes))
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
            kept = {n: self.spec.shapes[n] for n in staged.kept}  # left out on purpose by the sender
            return self.load_stream(staged.tensors, version, engine_names=True, unchanged=kept)[0]
        return self.load_stream(staged, version)[0]

    def load_stream(self, named: Iterable[tuple[str, torch.Tensor]], version: int, *,
                    engine_names: bool = False, unchanged: Mapping[str, tuple[int, ...]] | None = None
                    ) -> tuple[list[Receipt], str]:
        """Stream ``named`` into every replica in one session of ``rollout.options.bucket_mb`` buckets
        (:mod:`unirl_vllm.stream`); returns the receipts and the sender's fingerprint of what was sent.

        Each tensor is renamed (unless ``engine_names``), checked and copied as it arrives, so the
        trainer's process holds about two buckets, not the model. A bad tensor found after earlier
        buckets were loaded, a receipt that does not match, or a failed load puts the last committed
        version back (:mod:`unirl_vllm.committed`) and raises. ``unchanged`` (actor name -> shape): weights
        this sync leaves out because every replica holds them already (:mod:`unirl.sync.held`); each
        worker's completeness check accepts their absence (:meth:`unirl.api.Staged.leave_out`)."""
        from unirl_vllm.stream import SyncSession, checked

        with self.quiesced(version):
            if self._broken:
                raise WeightSyncError(f"engine is unusable after a failed recovery: {self._broken}")
            staged = Staged(spec=self.spec, expand=None if engine_names else self.engine_weights, keep=False)
            kept = staged.leave_out(unchanged or {})
            sent = Fingerprint()
            session = SyncSession(self._hosts, self.transports(), int(version), ray=self.options.on_ray, kept=kept)
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
            self._cached = 0  # every replica reset its prefix cache after loading (Host.sync_finish)
            receipts = [Receipt(**r) for r in raw]
            try:
                verify_receipts(int(version), receipts, sent.hexdigest())
            except WeightSyncError as exc:
                copy.discard()
                self._recover(str(exc))
                raise WeightSyncError(f"{exc}; the engine serves version {self.weight_version} again") from exc
            self._copy.commit(copy, sent.hexdigest(), kept)
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
            session = SyncSession(self._hosts, self.transports(), self.weight_version, ray=self.options.on_ray,
                                  kept=self._copy.kept)
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
        """The weight transport to each replica (:func:`unirl_vllm.replicas.transports`)."""
        return transports(self._hosts)

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
