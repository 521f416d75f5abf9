"""The ``vllm`` rollout engine: ``vllm.LLM`` (offline) in the trainer's process or in one Ray actor.

Two layers:

* :class:`_Host` owns one ``vllm.LLM`` and speaks plain data (token ids, floats, dicts), so the same
  class runs in-process or as a Ray actor;
* :class:`VLLMEngine` is the :class:`unirl.contracts.RolloutEngine` the trainer sees. It fills
  :class:`~unirl.samples.Sample` slots, stamps the committed weight version on every token, stages and
  validates weight syncs before anything reaches vLLM, refuses a sync while a generation is in flight,
  commits a version only when every worker's receipt matches, and otherwise puts the last committed
  weights back.

Where the engine's first weights come from: vLLM must start from a directory. ``model.path`` is used
when set; otherwise the adapter builds the model (seeded, so it equals the actor's initial weights)
and it is saved with its tokenizer to ``<run_dir>/engine_init``. Either way the trainer publishes the
actor's weights before the first rollout, so the directory only has to have the right architecture.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unirl.contracts import Receipt, RolloutEngine, SamplingParams, VersionLedger, fingerprint
from unirl.samples import Sample
from unirl_vllm.compat import check_vllm, is_cpu_build
from unirl_vllm.options import VLLMOptions
from unirl_vllm.spec import Staged, SyncRefused, WeightSpec, WeightSyncError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.config import RunConfig
    from unirl.contracts import ModelAdapter

EXTENSION = "unirl_vllm.extension.UniRLWorkerExtension"
ENGINE = "vllm"

#: Environment a vLLM host needs; set (unless already set) before vLLM is imported.
DEFAULT_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


class _Host:
    """Owns one ``vllm.LLM``. Plain-data methods only, so it can run as a Ray actor unchanged."""

    def __init__(self, llm_kwargs: dict[str, Any], env: dict[str, str], bucket_bytes: int) -> None:
        for key, value in env.items():
            os.environ.setdefault(key, value)
        check_vllm()
        from vllm import LLM, envs

        self.llm = LLM(**llm_kwargs)
        self.detokenize = not llm_kwargs.get("skip_tokenizer_init", False)
        # Workers outside this process (engine-core process, or one process per TP rank) get buckets as
        # tmpfs files: raw tensors do not pickle through vLLM's pipes.
        self.multiprocess = bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING) or int(
            llm_kwargs.get("tensor_parallel_size", 1)) > 1
        self.bucket_bytes = bucket_bytes
        pings = self.llm.collective_rpc("unirl_ping")
        self.workers = len(pings)

    def info(self) -> dict[str, Any]:
        return {"workers": self.workers, "multiprocess": self.multiprocess, "detokenize": self.detokenize}

    # ------------------------------------------------------------------ generation
    def generate(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r["prompt_ids"])) for r in requests]
        params = [
            VSP(
                max_tokens=r["max_tokens"], temperature=r["temperature"], top_p=r["top_p"], top_k=r["top_k"],
                seed=r["seed"], stop_token_ids=list(r["stop_token_ids"]) or None, stop=list(r["stop"]) or None,
                logprobs=0, detokenize=self.detokenize, ignore_eos=r.get("ignore_eos", False),
            )
            for r in requests
        ]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        result = []
        for out in outs:
            c = out.outputs[0]
            ids = [int(t) for t in c.token_ids]
            lps = [float(c.logprobs[i][tok].logprob) for i, tok in enumerate(ids)] if c.logprobs is not None else []
            result.append({"token_ids": ids, "logprobs": lps, "finish_reason": c.finish_reason or "",
                           "text": c.text or ""})
        return result

    # ------------------------------------------------------------------ weight sync
    def sync(self, version: int, manifest: list[tuple[str, tuple[int, ...], str]],
             tensors: list[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
        """One begin / load* / finish session on every worker; returns their receipts."""
        self.llm.collective_rpc("unirl_sync_begin", kwargs={"version": version, "manifest": manifest})
        try:
            for bucket in _buckets(tensors, self.bucket_bytes):
                if self.multiprocess:
                    # Raw tensors do not pickle through the engine-core pipe ("cannot pickle memoryview");
                    # a safetensors file on tmpfs does, at the cost of one copy.
                    with _shm_file(bucket) as path:
                        self.llm.collective_rpc("unirl_sync_load", kwargs={"path": path})
                else:
                    self.llm.collective_rpc("unirl_sync_load", kwargs={"weights": bucket})
            receipts = self.llm.collective_rpc("unirl_sync_finish")
        except BaseException:
            self.abort()
            raise
        if not self.llm.reset_prefix_cache():
            raise WeightSyncError("vLLM refused to reset its prefix cache (requests still running?)")
        return receipts

    def abort(self) -> list[bool]:
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
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except Exception:  # noqa: BLE001
            import gc

            gc.collect()


def _buckets(tensors: list[tuple[str, Any]], limit: int) -> Iterable[list[tuple[str, Any]]]:
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


class _shm_file:  # noqa: N801 - used as a context manager
    """A safetensors file of one bucket on tmpfs, removed on exit; tensor order kept in metadata."""

    def __init__(self, bucket: list[tuple[str, Any]]) -> None:
        self.bucket = bucket

    def __enter__(self) -> str:
        from safetensors.torch import save_file

        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="unirl-sync-", suffix=".safetensors", dir=root)
        os.close(fd)
        save_file(dict(self.bucket), self.path, metadata={"order": "\n".join(n for n, _ in self.bucket)})
        return self.path

    def __exit__(self, *exc: object) -> None:
        Path(self.path).unlink(missing_ok=True)


class _RayHost:
    """A :class:`_Host` inside one Ray actor; same methods, blocking."""

    def __init__(self, llm_kwargs: dict[str, Any], env: dict[str, str], bucket_bytes: int, num_cpus: float) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        actor_cls = ray.remote(_Host)
        self._ray = ray
        self._actor = actor_cls.options(num_cpus=num_cpus, runtime_env={"env_vars": env}).remote(
            llm_kwargs, env, bucket_bytes
        )

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._actor, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._ray.get(method.remote(*args, **kwargs))

        return call

    def close(self) -> None:
        try:
            self._ray.get(self._actor.close.remote())
        finally:
            self._ray.kill(self._actor)


class VLLMEngine(RolloutEngine):
    """vLLM as a UniRL rollout engine, with transactional in-place weight sync (see the module doc)."""

    Config = VLLMOptions

    def __init__(self, *, config: RunConfig, adapter: ModelAdapter, tokenizer: Any = None,
                 options: VLLMOptions | dict[str, Any] | None = None,
                 worker_env: dict[str, str] | None = None) -> None:
        if options is None:
            options = config.rollout.options
        self.options = options if isinstance(options, VLLMOptions) else VLLMOptions.model_validate(options)
        self.config = config
        self.adapter = adapter
        self.tokenizer = tokenizer
        self.ledger = VersionLedger()
        self._lock = threading.Lock()
        self._inflight = 0
        self._syncing = False
        self._broken: str | None = None
        self._committed: list[tuple[str, torch.Tensor]] | None = None  # None: the start-up checkpoint
        self.model_dir = self._prepare_model_dir()
        self.dtype = f"torch.{config.model.dtype}"
        self.spec = WeightSpec.from_checkpoint(self.model_dir, self.dtype)
        self.llm_kwargs = self._llm_kwargs()
        # every plugin's unirl_worker_env (e.g. parity flags) must reach the process that hosts vLLM
        env = {**DEFAULT_ENV, **(worker_env or {})}
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        bucket_bytes = 256 << 20
        t0 = time.perf_counter()
        if self.options.placement == "ray":
            self._host: Any = _RayHost(self.llm_kwargs, env, bucket_bytes, self.options.ray_num_cpus)
        else:
            self._host = _Host(self.llm_kwargs, env, bucket_bytes)
        self.startup_seconds = time.perf_counter() - t0
        self.host_info: dict[str, Any] = self._host.info()

    # ------------------------------------------------------------------ set-up
    @property
    def weight_version(self) -> int:  # type: ignore[override]
        """The last *committed* version; a failed sync leaves it (and the weights) unchanged."""
        return self.ledger.version

    def _prepare_model_dir(self) -> str:
        if self.config.model.path:
            return str(self.config.model.path)
        out = Path(self.config.run_dir) / "engine_init"
        out.mkdir(parents=True, exist_ok=True)
        tok = self.tokenizer if self.tokenizer is not None else self.adapter.build_tokenizer(self.config)
        self.tokenizer = tok
        model = self.adapter.build_model(self.config, tok)
        model.save_pretrained(str(out))
        if hasattr(tok, "save_pretrained"):
            tok.save_pretrained(str(out))
        del model
        return str(out)

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
        if o.kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(o.kv_cache_gb * (1 << 30))
        if o.max_model_len is not None:
            kwargs["max_model_len"] = o.max_model_len
        if not is_cpu_build():  # on the CPU this knob sizes a memory check, not the KV cache
            kwargs["gpu_memory_utilization"] = o.gpu_memory_utilization
        kwargs.update(self.adapter.engine_args(ENGINE, self.config))
        kwargs.update(o.engine_args)
        return kwargs

    def engine_weight_name(self, name: str) -> str:
        """The actor's parameter name as this engine's checkpoint names it (the adapter decides)."""
        return self.adapter.engine_weight_name(name, ENGINE)

    # ------------------------------------------------------------------ generation
    def generate(self, samples: list[Sample], sampling: SamplingParams) -> list[Sample]:
        if self._broken:
            raise WeightSyncError(f"engine is unusable after a failed recovery: {self._broken}")
        with self._lock:
            if self._syncing:
                raise SyncRefused("generate() called while a weight sync is running")
            self._inflight += 1
            version = self.weight_version
        try:
            stop = list(self.config.rollout.stop)
            if stop and not self.host_info["detokenize"]:
                raise ValueError("rollout.stop strings need a tokenizer in the engine's model directory "
                                 "(skip_tokenizer_init is on); use stop token ids instead")
            requests = [
                {"prompt_ids": s.prompt_ids, "max_tokens": sampling.max_new_tokens,
                 "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                 "seed": s.seed, "stop_token_ids": sampling.stop_token_ids, "stop": stop,
                 "ignore_eos": self.options.ignore_eos}
                for s in samples
            ]
            outs = self._host.generate(requests) if requests else []
        finally:
            with self._lock:
                self._inflight -= 1
        for s, out in zip(samples, outs, strict=True):
            ids = out["token_ids"]
            s.response_ids = ids
            s.loss_mask = [1] * len(ids)
            s.rollout_logprobs = out["logprobs"] if sampling.logprobs else [0.0] * len(ids)
            s.versions = [version] * len(ids)
            s.finish_reason = out["finish_reason"]
            if out["finish_reason"] == "length":
                s.status = "truncated"
            elif out["finish_reason"] == "stop":
                s.status = "ok"
            else:
                s.mark_failed(f"vllm finished with {out['finish_reason']!r}")
            text = out["text"]
            if not text and self.tokenizer is not None and ids:
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
            s.response_text = text
            s.meta["engine"] = ENGINE
            s.meta["logprobs_mode"] = self.options.logprobs_mode
        return samples

    @property
    def in_flight(self) -> int:
        return self._inflight

    # ------------------------------------------------------------------ weight sync
    def stage(self) -> Staged:
        """An empty staging area for one sync: names mapped through the adapter, checked as they arrive."""
        return Staged(spec=self.spec, rename=self.engine_weight_name)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Staged, version: int) -> list[Receipt]:
        """Validate everything, then load it in one session; commit ``version`` only if every receipt
        matches. On any failure the previous committed weights serve again and this raises
        :class:`WeightSyncError` (:class:`SyncRefused` while a generation is in flight)."""
        with self._lock:
            if self._inflight:
                raise SyncRefused(f"weight sync to version {version} refused: {self._inflight} generation(s) in "
                                  "flight; quiesce the engine (drain or wait) first")
            if self._syncing:
                raise SyncRefused(f"weight sync to version {version} refused: another sync is running")
            self._syncing = True
        try:
            if self._broken:
                raise WeightSyncError(f"engine is unusable after a failed recovery: {self._broken}")
            staged = named_tensors if isinstance(named_tensors, Staged) else self._stage_all(named_tensors)
            manifest = staged.finish()  # raises before anything reached vLLM
            expected = getattr(staged, "fingerprint", None) or fingerprint(staged.tensors)
            staged.closed = True
            try:
                raw = self._host.sync(int(version), manifest, staged.tensors)
            except Exception as exc:
                self._recover(f"loading version {version} failed: {type(exc).__name__}: {exc}")
                raise WeightSyncError(f"weight sync to version {version} failed while loading ({exc}); "
                                      f"the engine serves version {self.weight_version} again") from exc
            receipts = [Receipt(**r) for r in raw]
            try:
                self.ledger.commit(int(version), receipts, expected)
            except RuntimeError as exc:
                self._recover(str(exc))
                raise WeightSyncError(f"{exc}; the engine serves version {self.weight_version} again") from exc
            self._committed = staged.tensors
            return receipts
        finally:
            with self._lock:
                self._syncing = False

    def _stage_all(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Staged:
        staged = self.stage()
        for name, tensor in named_tensors:
            staged.add(name, tensor)
        return staged

    def _recover(self, why: str) -> None:
        """Put the last committed weights back (from the staged copy, or the start-up checkpoint)."""
        try:
            self._host.abort()
            tensors = self._committed if self._committed is not None else self._checkpoint_tensors()
            manifest = [(n, tuple(t.shape), str(t.dtype)) for n, t in tensors]
            self._host.sync(self.weight_version, manifest, tensors)
        except Exception as exc:  # noqa: BLE001 - report both failures
            self._broken = f"{why}; then restoring version {self.weight_version} failed: {exc}"

    def _checkpoint_tensors(self) -> list[tuple[str, torch.Tensor]]:
        import torch
        from safetensors.torch import load_file

        dtype = getattr(torch, self.dtype.removeprefix("torch."))
        out: list[tuple[str, torch.Tensor]] = []
        for f in sorted(Path(self.model_dir).glob("*.safetensors")):
            out.extend((n, t.to(dtype)) for n, t in load_file(str(f)).items())
        return out

    def close(self) -> None:
        host = getattr(self, "_host", None)
        self._host = None
        if host is not None:
            host.close()
