"""The ``sglang`` rollout engine: one or more SGLang servers, driven over SGLang's native HTTP API.

:class:`SGLangEngine` is a :class:`~unirl.api.QueuedEngine` (submit / poll / abort / pause / resume):
its :meth:`SGLangEngine._run` turns one submission into ``POST /generate`` requests:

* seeded samples go as batched requests: ``input_ids`` = a list of whole contexts, ``sampling_params``
  one dict per sample with ``sampling_seed = sample.turn_seed()``, one ``rid`` per sample,
  ``return_logprob: true``. Seeded siblings are *not* folded into ``n``: SGLang copies one request's
  ``sampling_params`` (its seed included) to all ``n`` copies, which would make them identical;
* unseeded samples with the same context and budget go as one request with ``sampling_params.n = k``;
  SGLang answers with a list of ``k`` outputs (``TokenizerManager._handle_batch_request`` expands the
  request prompt-major), handed to the samples in order;
* requests are spread over the servers (least loaded first), at most ``max_concurrency`` in flight per
  server; a connection error is retried with backoff (:mod:`unirl_sglang.client`), then fails the
  submission with a clear error naming the server;
* the turn's tokens and log-probs come from ``meta_info.output_token_logprobs``
  (``[logprob, token_id, text|null]`` per generated token), checked against ``output_ids``; the
  finish reason from ``meta_info.finish_reason.type``; ``meta_info.weight_version``, when the server
  sends it, must be the version this engine committed (a restarted server that came back with its
  start-up weights is an error, not silently stale tokens);
* per-request times come from each item's ``meta_info`` (``e2e_latency``; with ``--enable-metrics``
  also ``request_received_ts`` / ``prefill_finished_ts`` for the first token), see :func:`request_times`;
* ``abort`` sends ``POST /abort_request {rid}`` for every request in flight; SGLang answers those
  requests with what they generated so far and ``finish_reason.type == "abort"``.

Weights (:meth:`SGLangEngine.load_weights`): stage and validate with :mod:`unirl.api` staging, write
a versioned safetensors directory (:mod:`unirl_sglang.export`), re-read its fingerprint, then on every
server ``/pause_generation`` -> ``/update_weights_from_disk {model_path, weight_version}`` ->
``/flush_cache`` -> ``/continue_generation``, and read back ``/get_model_info``. A version is served
only if every server reports that directory and that version; otherwise the servers that moved are
put back on the committed directory and this raises :class:`~unirl.api.WeightSyncError`.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unirl.api import (
    EngineCapabilities,
    Handle,
    QueuedEngine,
    Receipt,
    SampleError,
    SamplingParams,
    Staged,
    WeightSpec,
    WeightSyncError,
    engine_init_dir,
    fingerprint,
    now_ms,
    stage_all,
    verify_receipts,
    weight_buckets,
)
from unirl_sglang import export
from unirl_sglang.client import SGLangRequestError, SGLangServer, SGLangUnavailableError
from unirl_sglang.launch import ServerProcesses
from unirl_sglang.memory_layout import sglang_layout
from unirl_sglang.options import SGLangOptions

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.api import ModelAdapter, RunConfig, Runtime, Sample

ENGINE = "sglang"
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass
class _Request:
    """One ``/generate`` call: its samples (``n = len(samples)``) and the JSON body."""

    samples: list[Sample]
    body: dict[str, Any]
    server: SGLangServer | None = None
    rid: str = ""
    rids: list[str] = field(default_factory=list)
    sent_ms: float = 0.0  # when the /generate call left (now_ms): the anchor of the server's durations


def request_times(meta: dict[str, Any], sent_ms: float, reply_ms: float) -> tuple[float, float]:
    """``(first_token_ms, finished_ms)`` of one output on this process's clock (:func:`now_ms`).

    Why from ``meta_info``: a batched ``/generate`` answers every item at once, so the reply's arrival
    is the batch's end, not the item's. SGLang's ``TokenizerManager`` puts ``e2e_latency`` (seconds
    from receiving the request to that item's finish) in every item's ``meta_info``; a server started
    with ``--enable-metrics`` adds ``request_received_ts`` and ``prefill_finished_ts`` (its wall clock).
    Only *differences* of the server's times are used, anchored at ``sent_ms``, so a server on another
    host with a skewed clock still gives our clock's times; both are clamped to ``[sent_ms, reply_ms]``.
    The first token is 0.0 (not measured) without ``--enable-metrics``; the finish falls back to the
    reply's arrival when ``e2e_latency`` is missing."""
    def num(key: str) -> float | None:
        v = meta.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    e2e = num("e2e_latency")
    finished = reply_ms if e2e is None else min(reply_ms, max(sent_ms, sent_ms + 1000.0 * e2e))
    received, prefilled = num("request_received_ts"), num("prefill_finished_ts")
    first = 0.0
    if received is not None and prefilled is not None:
        first = min(finished, max(sent_ms, sent_ms + 1000.0 * (prefilled - received)))
    return first, finished


class SGLangEngine(QueuedEngine):
    """SGLang servers as a UniRL rollout engine (see the module doc)."""

    name = ENGINE
    Config = SGLangOptions
    memory_layout = classmethod(sglang_layout)  # the memory plan's declaration (unirl_sglang.memory_layout)

    @classmethod
    def capabilities(cls, config: RunConfig, options: SGLangOptions) -> EngineCapabilities:
        # Without SGLANG_RETURN_ORIGINAL_LOGPROB, SGLang returns log-probs after temperature scaling:
        # raw only when the temperature is 1.
        raw = options.original_logprobs or float(config.rollout.temperature) == 1.0
        # every server holds the weights and answers a sync with a receipt (TP lives inside a server)
        servers = len(options.servers) or (len(options.launch.ports) if options.launch else 1)
        # requests_across_sync "queued" (stream mode): a job waiting in QueuedEngine is not yet on a server, so a
        # paused sync loads under it and it starts under the new weights; a running job's HTTP requests end
        # under theirs (or, on_sync: abort, are aborted on the server and rerun: QueuedEngine.restart_running)
        return EngineCapabilities(weight_syncs=("sglang",), logprobs="raw" if raw else "processed",
                                  continuation=True, async_submit=True, workers=servers,
                                  batching="continuous",  # SGLang's scheduler admits rows at every step
                                  requests_across_sync="queued")

    def __init__(self, *, config: RunConfig, adapter: ModelAdapter, runtime: Runtime, options: SGLangOptions,
                 tokenizer: Any = None) -> None:
        """``options``: ``rollout.options`` as the kernel validated it (it names the servers: no default)."""
        super().__init__()
        self.options = options
        self.config = config
        self.adapter = adapter
        self.tokenizer = tokenizer
        self.runtime = runtime
        self._broken: str | None = None
        self._counter = itertools.count()
        model_dir, self.tokenizer = engine_init_dir(config, adapter, self.tokenizer)
        self.model_dir = Path(model_dir)
        self.dtype = f"torch.{config.model.dtype}"
        self.spec = WeightSpec.from_checkpoint(self.model_dir, self.dtype)
        self.export_root = Path(self.options.export_dir or Path(config.run_dir) / "sglang_weights")
        o = self.options
        self.servers = [SGLangServer(url, i, max_concurrency=o.max_concurrency, timeout_s=o.request_timeout_s,
                                     retries=o.retries, backoff_s=o.backoff_s, backoff_max_s=o.backoff_max_s)
                        for i, url in enumerate(o.urls())]
        self._load = {s.index: 0 for s in self.servers}
        self._load_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=len(self.servers) * o.max_concurrency,
                                        thread_name_prefix="sglang-http")
        self.processes: ServerProcesses | None = None
        t0 = time.perf_counter()
        try:
            if o.launch is not None:
                self.processes = ServerProcesses(o.launch, str(self.model_dir), Path(config.run_dir),
                                                 o.original_logprobs)
                self.processes.wait_healthy(self.servers, o.launch.startup_timeout_s)
            for s in self.servers:
                s.healthy(o.health_timeout_s)
            infos = [s.call("GET", "/get_model_info") for s in self.servers]
        except BaseException:
            self.close()
            raise
        # what every server serves now: the committed (directory, weight_version) pair
        self._committed_dir: Path = Path(str(infos[0].get("model_path") or self.model_dir))
        self._served_tag: str | None = infos[0].get("weight_version")
        tags = {i.get("weight_version") for i in infos}
        if len(tags) > 1:
            self.close()
            raise WeightSyncError(f"the SGLang servers start on different weight versions {sorted(map(str, tags))}; "
                                  "start them from the same checkpoint")
        self.startup_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ set-up
    def engine_weight_name(self, name: str) -> str:
        return self.adapter.engine_weight_name(name, ENGINE)

    # ------------------------------------------------------------------ generation
    def submit(self, samples: list[Sample], sampling: SamplingParams) -> Handle:
        if self._broken:
            raise WeightSyncError(f"engine is unusable after a failed recovery: {self._broken}")
        return super().submit(samples, sampling)

    def _sampling_params(self, sampling: SamplingParams, limit: int, seed: int | None, n: int) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": int(limit),
            "temperature": float(sampling.temperature),
            "top_p": float(sampling.top_p),
            "top_k": int(sampling.top_k) if sampling.top_k > 0 else -1,  # SGLang: -1 disables top-k
            "stop_token_ids": [int(t) for t in sampling.stop_token_ids],
            "skip_special_tokens": True,
        }
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        if self.options.ignore_eos or sampling.ignore_eos:
            params["ignore_eos"] = True
            # the trainer lists eos among the stop ids; SGLang would still stop on it there
            eos = getattr(self.tokenizer, "eos_token_id", None)
            params["stop_token_ids"] = [t for t in params["stop_token_ids"] if t != eos]
        if sampling.min_new_tokens:
            params["min_new_tokens"] = min(int(sampling.min_new_tokens), int(limit))
        if seed is not None:
            params["sampling_seed"] = int(seed)
        if n > 1:
            params["n"] = n
        return params

    def _requests(self, samples: list[Sample], sampling: SamplingParams, version: int) -> list[_Request]:
        groups: dict[tuple[tuple[int, ...], int], list[Sample]] = {}
        seeded: list[tuple[Sample, int, int]] = []
        out: list[_Request] = []
        for s in samples:
            limit = sampling.new_token_limit(s)
            if limit <= 0:  # the response budget is spent: an empty turn, no request
                self._finish_turn(s, [], [], "length", "", version)
                continue
            seed = s.turn_seed()
            if seed is None:
                groups.setdefault((tuple(s.context_ids), limit), []).append(s)
            else:
                seeded.append((s, limit, seed))
        # seeded samples: batched requests (one input_ids list and one sampling_params dict per sample),
        # split so every request slot of every server has work
        slots = len(self.servers) * self.options.max_concurrency
        size = max(1, min(self.options.max_batch, -(-len(seeded) // slots))) if seeded else 1
        for c in range(0, len(seeded), size):
            chunk = seeded[c : c + size]
            out.append(_Request([s for s, _, _ in chunk], {
                "input_ids": [list(s.context_ids) for s, _, _ in chunk],
                "sampling_params": [self._sampling_params(sampling, lim, seed, 1) for _, lim, seed in chunk]}))
        for (ctx, limit), members in groups.items():
            out.append(_Request(members, {"input_ids": list(ctx),
                                          "sampling_params": self._sampling_params(sampling, limit, None,
                                                                                   len(members))}))
        for r in out:
            r.body["return_logprob"] = True  # the turn records them either way (tokens come from them)
            r.body["stream"] = False
        return out

    def _pick_server(self) -> SGLangServer:
        with self._load_lock:
            server = min(self.servers, key=lambda s: (self._load[s.index], s.index))
            self._load[server.index] += 1
            return server

    def _send(self, req: _Request) -> Any:
        """Run one request on its server (a slot held for the whole call, retries included)."""
        server = req.server
        assert server is not None
        try:
            with server.slots:
                req.rid = f"unirl-{uuid.uuid4().hex}"
                batch = isinstance(req.body["input_ids"][0], list)
                # a batch names each item (SGLang keeps given rids, so each is abortable); a single
                # request with n > 1 cannot be: SGLang gives its copies fresh rids
                req.rids = [f"{req.rid}-{i}" for i in range(len(req.samples))] if batch else [req.rid]
                req.body["rid"] = req.rids if batch else req.rid
                req.sent_ms = now_ms()
                return server.call("POST", "/generate", req.body)
        finally:
            with self._load_lock:
                self._load[server.index] -= 1

    def _run(self, samples: list[Sample], sampling: SamplingParams, should_stop: Callable[[], bool],
             version: int) -> None:
        requests = self._requests(samples, sampling, version)
        if not requests:
            return
        if should_stop():
            for r in requests:
                for s in r.samples:
                    self._finish_turn(s, [], [], "abort", "", version)
            return
        futures: dict[Future, _Request] = {}
        for r in requests:
            r.server = self._pick_server()
            futures[self._pool.submit(self._send, r)] = r
        pending = set(futures)
        aborted = False
        try:
            while pending:
                done, pending = wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)
                for f in done:
                    r = futures[f]
                    self._apply(r, f.result(), sampling, version)
                if pending and not aborted and should_stop():
                    aborted = True
                    self._abort_rids([futures[f] for f in pending])
        except BaseException:
            self._abort_rids([futures[f] for f in pending])
            for f in pending:
                f.cancel()
            raise

    def _abort_rids(self, reqs: list[_Request]) -> None:
        for r in reqs:
            for rid in r.rids if r.server is not None else []:
                try:
                    r.server.call("POST", "/abort_request", {"rid": rid}, retries=0, timeout_s=10)
                except Exception:  # noqa: BLE001 - best effort; the request still answers or fails
                    pass

    def _apply(self, req: _Request, result: Any, sampling: SamplingParams, version: int) -> None:
        outs = result if isinstance(result, list) else [result]
        where = f"SGLang server {req.server.url if req.server else '?'} /generate"
        if len(outs) != len(req.samples):
            raise SampleError(f"{where}: {len(outs)} outputs for {len(req.samples)} samples (n={len(req.samples)})")
        t = now_ms()
        for s, out in zip(req.samples, outs, strict=True):
            meta = out.get("meta_info") or {}
            served = meta.get("weight_version")
            if served is not None and self._served_tag is not None and str(served) != str(self._served_tag):
                raise WeightSyncError(
                    f"{where}: served weight_version {served!r}, but the committed version is "
                    f"{self._served_tag!r} (the server restarted with its start-up weights, or another client "
                    "updated it); re-sync the weights before generating")
            triples = meta.get("output_token_logprobs")
            if triples is None:
                raise SampleError(f"{where}: meta_info has no output_token_logprobs (return_logprob was sent)")
            ids = [int(tr[1]) for tr in triples]
            lps = [float(tr[0]) for tr in triples]
            output_ids = out.get("output_ids")
            if output_ids is not None and [int(x) for x in output_ids] != ids:
                raise SampleError(f"{where}: output_ids {output_ids[:8]}.. disagree with the log-prob tokens {ids[:8]}..")
            reason = (meta.get("finish_reason") or {}).get("type", "stop")
            text = out.get("text") or ""
            if not text and ids and self.tokenizer is not None:
                stop_ids = set(sampling.stop_token_ids)
                text_ids = ids[:-1] if reason == "stop" and ids[-1] in stop_ids else ids
                text = self.tokenizer.decode(text_ids, skip_special_tokens=True)
            rec = s.requests[-1]
            first, finished = request_times(meta, req.sent_ms or rec.submitted_ms, t)
            rec.first_token_ms = rec.first_token_ms or (first if ids else 0.0)
            rec.finished_ms = finished  # this item's own end (meta_info), not the batched reply's arrival
            if isinstance(meta.get("cached_tokens"), int):
                rec.cached_tokens = int(meta["cached_tokens"])
            rec.worker = str(req.server.index if req.server else 0)
            self._finish_turn(s, ids, lps if sampling.logprobs else [0.0] * len(ids),
                              _FINISH.get(reason, "error"), text, version)

    def _finish_turn(self, s: Sample, ids: list[int], lps: list[float], reason: str, text: str,
                     version: int) -> None:
        s.append_model_turn(ids, lps, version, reason, text=text)
        s.meta["engine"] = ENGINE
        s.meta["logprobs_mode"] = "raw" if self.options.original_logprobs else "after_temperature"

    # ------------------------------------------------------------------ weight sync
    def stage(self) -> Staged:
        return Staged(spec=self.spec, rename=self.engine_weight_name)

    def load_weights(self, staged: Staged | Iterable[tuple[str, torch.Tensor]], version: int) -> list[Receipt]:
        """Export ``staged`` as a versioned directory and load it on every server (see the module doc)."""
        with self.quiesced(version):
            self._check_usable()
            if not isinstance(staged, Staged):
                staged = stage_all(self.spec, staged, self.engine_weight_name)
            staged.finish()  # raises before anything is written or sent
            if _same_path(export.version_dir(self.export_root, version), self._committed_dir):
                raise WeightSyncError(f"version {version} is the one being served; a sync needs a new version "
                                      "number (its directory is never rewritten)")
            expected = staged.fingerprint or fingerprint(staged.tensors)
            staged.closed = True
            path = export.write_version(self.export_root, version, staged.tensors, expected, self.model_dir)
            receipts = self._update_from_dir(path, version, expected)
            export.prune(self.export_root, self.options.keep_versions, {self._committed_dir})
            return receipts

    def _check_usable(self) -> None:
        if self._broken:
            raise WeightSyncError(f"engine is unusable after a failed recovery: {self._broken}")

    def _update_from_dir(self, path: Path, version: int, expected: str) -> list[Receipt]:
        """Steps 2-5 of :meth:`load_weights` for the directory it just wrote, holding ``expected``."""
        t0 = time.perf_counter()
        on_disk = export.read_fingerprint(path)  # a bad file fails here, before any server
        if on_disk[0] != expected:
            raise WeightSyncError(f"weight directory {path} does not hold what was staged (fingerprint "
                                  f"{on_disk[0][:12]} != {expected[:12]}); nothing was sent to the servers")
        tag = str(version)
        body = {"model_path": str(path), "weight_version": tag, "abort_all_requests": False, "flush_cache": True}
        errors: dict[int, str] = {}
        self._each("POST", "/pause_generation", {"mode": "retract"}, errors)
        try:
            self._each("POST", "/update_weights_from_disk", body, errors)
            self._each("POST", "/flush_cache", None, errors, skip=set(errors))
        finally:
            self._each("POST", "/continue_generation", {}, errors)
        infos = self._model_infos()
        receipts = []
        for s in self.servers:
            info = infos.get(s.index) or {}
            confirmed = (s.index not in errors and str(info.get("weight_version")) == tag
                         and _same_path(info.get("model_path"), path))
            served = info.get("weight_version")
            receipts.append(Receipt(worker=s.index, version=int(served) if str(served).isdigit() else -1,
                                    fingerprint=on_disk[0] if confirmed else "",
                                    num_tensors=on_disk[1], seconds=time.perf_counter() - t0,
                                    transport="disk", node=self._url(s.index)))
        try:
            if errors:
                detail = "; ".join(f"{self._url(i)}: {m}" for i, m in sorted(errors.items()))
                raise WeightSyncError(f"weight sync to version {version} failed: {detail}")
            verify_receipts(int(version), receipts, expected)
        except WeightSyncError as exc:
            self._restore(str(exc))
            raise WeightSyncError(f"{exc}; the servers serve version {self.weight_version} "
                                  f"({self._committed_dir}) again") from exc
        self._committed_dir = path
        self._served_tag = tag
        self._set_version(int(version))
        return receipts

    def _url(self, index: int) -> str:
        return self.servers[index].url

    def _each(self, method: str, path: str, body: dict[str, Any] | None, errors: dict[int, str],
              skip: set[int] = frozenset()) -> dict[int, Any]:
        """Call every server concurrently; record failures in ``errors`` (first one per server wins)."""
        targets = [s for s in self.servers if s.index not in skip]
        futs = {s.index: self._pool.submit(s.call, method, path, body) for s in targets}
        out: dict[int, Any] = {}
        for i, f in futs.items():
            try:
                res = f.result()
                if isinstance(res, dict) and res.get("success") is False:
                    errors.setdefault(i, f"{path}: {res.get('message')}")
                out[i] = res
            except (SGLangRequestError, SGLangUnavailableError) as exc:
                body_ = exc.body if isinstance(exc, SGLangRequestError) else None
                msg = body_.get("message") if isinstance(body_, dict) and body_.get("message") else str(exc)
                errors.setdefault(i, f"{path}: {msg}")
        return out

    def _model_infos(self) -> dict[int, dict[str, Any]]:
        errs: dict[int, str] = {}
        infos = self._each("GET", "/get_model_info", None, errs)
        return {i: v for i, v in infos.items() if isinstance(v, dict)}

    def _restore(self, why: str) -> None:
        """Put every server that moved back on the committed directory and version."""
        tag = self._served_tag
        infos = self._model_infos()
        moved = {s.index for s in self.servers
                 if s.index not in infos or str(infos[s.index].get("weight_version")) != str(tag)
                 or not _same_path(infos[s.index].get("model_path"), self._committed_dir)}
        if not moved:
            return
        errors: dict[int, str] = {}
        skip = {s.index for s in self.servers} - moved
        body = {"model_path": str(self._committed_dir), "abort_all_requests": False, "flush_cache": True}
        if tag is not None:
            body["weight_version"] = tag
        self._each("POST", "/update_weights_from_disk", body, errors, skip=skip)
        self._each("POST", "/flush_cache", None, errors, skip=skip | set(errors))
        infos = self._model_infos()
        still = [self._url(i) for i in moved if i in errors or str((infos.get(i) or {}).get("weight_version")) != str(tag)]
        if still:
            self._broken = f"{why}; then restoring {self._committed_dir} failed on {still}: {errors}"

    # ------------------------------------------------------------------ distributed (NCCL) path
    def load_distributed(self, staged: Staged, version: int, broadcast: Callable[[torch.Tensor], None],
                         group_name: str, bucket_bytes: int) -> list[Receipt]:
        """Broadcast a staged set over an initialised weight-update group (GPU; not run in this project's CI).

        Per bucket, every server gets ``POST /update_weights_from_distributed {names, dtypes, shapes,
        group_name, flush_cache, weight_version}`` while rank 0 (this process) broadcasts each tensor in
        that order. The receipts hold the sender's fingerprint for every server that reports the new
        ``weight_version``: over NCCL the servers cannot echo a fingerprint of what they received."""
        with self.quiesced(version):
            self._check_usable()
            staged.finish()
            expected = staged.fingerprint or fingerprint(staged.tensors)
            staged.closed = True
            t0 = time.perf_counter()
            errors: dict[int, str] = {}
            tag = str(version)
            buckets = list(weight_buckets(staged.tensors, bucket_bytes))
            self._each("POST", "/pause_generation", {"mode": "retract"}, errors)
            try:
                for b, bucket in enumerate(buckets):
                    last = b == len(buckets) - 1
                    body = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.")
                                                                       for _, t in bucket],
                            "shapes": [list(t.shape) for _, t in bucket], "group_name": group_name,
                            "flush_cache": last, "abort_all_requests": False}
                    if last:
                        body["weight_version"] = tag
                    futs = [self._pool.submit(s.call, "POST", "/update_weights_from_distributed", body)
                            for s in self.servers]
                    for _, t in bucket:
                        broadcast(t)
                    for s, f in zip(self.servers, futs, strict=True):
                        try:
                            res = f.result()
                            if isinstance(res, dict) and res.get("success") is False:
                                errors.setdefault(s.index, str(res.get("message")))
                        except Exception as exc:  # noqa: BLE001 - reported below
                            errors.setdefault(s.index, str(exc))
                    if errors:
                        break
            finally:
                self._each("POST", "/continue_generation", {}, errors)
            infos = self._model_infos()
            receipts = [Receipt(worker=s.index, version=int(tag) if str((infos.get(s.index) or {}).get(
                "weight_version")) == tag else -1, fingerprint=expected if s.index not in errors else "",
                num_tensors=len(staged.tensors), seconds=time.perf_counter() - t0, transport="nccl",
                node=self._url(s.index)) for s in self.servers]
            try:
                if errors:
                    raise WeightSyncError(f"distributed weight sync to version {version} failed: {errors}")
                verify_receipts(int(version), receipts, expected)
            except WeightSyncError as exc:
                self._restore(str(exc))
                raise
            self._served_tag = tag
            self._set_version(int(version))
            return receipts

    def close(self) -> None:
        super().close()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        procs = getattr(self, "processes", None)
        self.processes = None
        if procs is not None:
            procs.stop()


def _same_path(a: Any, b: Path) -> bool:
    if a is None:
        return False
    try:
        return Path(str(a)).resolve() == Path(b).resolve()
    except OSError:
        return str(a) == str(b)


