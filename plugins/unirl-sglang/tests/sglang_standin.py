"""A stand-in SGLang server for tests: SGLang 0.5.23's native HTTP endpoints on UniRL's torch engine.

SGLang cannot run on this CPU-only machine (its kernels are CUDA-only), so the plugin's tests drive
this server instead. It speaks the request and response shapes of SGLang's own
``python/sglang/srt/entrypoints/http_server.py`` and ``managers/io_struct.py`` (see the plugin README
for the commit read), and every answer is a real model computation: generation, log-probs and weight
loads run on :class:`unirl.engine.torch_engine.TorchEngine` over the checkpoint it was started from.

What it implements, as SGLang does:

* ``POST /generate``: ``input_ids`` (one prompt or a batch), ``sampling_params`` (a dict or one per
  prompt: ``n``, ``temperature``, ``top_p``, ``top_k`` (-1 = off), ``max_new_tokens``,
  ``stop_token_ids``, ``sampling_seed``), ``return_logprob``, ``rid``. ``n > 1`` expands prompt-major
  (prompt i's copies are outputs ``i*n .. i*n+n-1``) and gives the copies fresh rids, so
  ``/abort_request`` by the parent rid does not reach them (as in SGLang). Output per sequence:
  ``text``, ``output_ids``, ``meta_info`` with ``id``, ``finish_reason`` (``{"type": "stop", "matched":
  id}``, ``{"type": "length", "length": n}``, ``{"type": "abort", ...}``), ``prompt_tokens``,
  ``completion_tokens``, ``cached_tokens``, ``weight_version`` and ``output_token_logprobs`` as
  ``[logprob, token_id, null]`` triples. A single prompt with n == 1 answers one object, else a list;
* ``GET /health_generate`` and ``/health``; ``GET /get_model_info`` (``model_path``, ``weight_version``
  ...); ``GET /get_weight_version``;
* ``POST /update_weights_from_disk`` (``model_path``, ``weight_version``; 200 ``{"success": true, ...}``
  or 400 ``{"success": false, "message": ...}`` with the old weights still serving, since SGLang rolls a
  failed load back); it waits for running generations first (SGLang holds a writer lock);
* ``POST /flush_cache`` (400 while a generation runs), ``/pause_generation`` (new generations wait),
  ``/continue_generation``, ``/abort_request`` (``rid`` or ``abort_all``);
* ``/init_weights_update_group`` and ``/update_weights_from_distributed`` answer 400: no NCCL here.

Log-probs are always the *original* ones (``log_softmax`` of the raw logits), i.e. the server behaves
as SGLang launched with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``; started with that variable set to 0 it
refuses temperatures other than 1 instead of faking the after-temperature values.

Not implemented (answered 400 when asked for): text prompts, stop strings, ``ignore_eos``,
``min_new_tokens``, streaming. Test hooks: :meth:`StandIn.crash` / :meth:`StandIn.restart`,
``fail_next_update``, ``log`` (every request), ``max_active`` (most concurrent ``/generate``).

Run it as a server: ``python sglang_standin.py --model-path DIR --host 127.0.0.1 --port 30000``
(the flags of ``python -m sglang.launch_server``; unknown flags are ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from unirl.api import default_runtime

_SAMPLING_KEYS = {"n", "temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "sampling_seed",
                  "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "min_p",
                  "ignore_eos", "min_new_tokens", "stop", "frequency_penalty", "presence_penalty",
                  "repetition_penalty"}


class _BadRequest(Exception):
    pass


class StandIn:
    """One stand-in server on ``host:port`` (port 0: any free port), serving ``model_dir``."""

    def __init__(self, model_dir: str | Path, host: str = "127.0.0.1", port: int = 0, *, dtype: str = "float32",
                 original_logprob: bool = True, enable_metrics: bool = False) -> None:
        from unirl.api import Qwen3Adapter, RunConfig
        from unirl.engine.torch_engine import TorchEngine

        self.startup_dir = str(model_dir)
        self.model_path = str(model_dir)
        self.weight_version = "default"
        self.original_logprob = original_logprob
        self.enable_metrics = enable_metrics  # SGLang's --enable-metrics: timestamps in meta_info
        config = RunConfig.model_validate({"model": {"path": str(model_dir), "dtype": dtype},
                                           "rollout": {"engine": "torch"}})
        adapter = Qwen3Adapter()
        self.engine = TorchEngine(config=config, runtime=default_runtime(config), adapter=adapter, tokenizer=adapter.build_tokenizer(config))
        self._loads = 0
        self._cv = threading.Condition()
        self.paused = False
        self.active = 0
        self.max_active = 0
        self._generating = 0
        self._updating = False
        self._aborts: set[str] = set()
        self._live: set[str] = set()
        self.crashed = False
        self.epoch = 0  # bumped by crash(): connections accepted before it never get an answer
        self.fail_next_update: str | None = None
        self.log: list[tuple[str, Any]] = []
        self.host = host
        self.port = port
        self._httpd: ThreadingHTTPServer | None = None
        self.start()

    # ------------------------------------------------------------------ lifecycle (test hooks)
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        handler = type("Handler", (_Handler,), {"standin": self})
        self._httpd = ThreadingHTTPServer((self.host, self.port), handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, name=f"standin-{self.port}", daemon=True).start()

    def crash(self) -> None:
        """Die like a killed server: stop listening, drop every in-flight request without an answer."""
        self.crashed = True
        with self._cv:
            self.epoch += 1
            self.paused = False  # let held requests drain (their answers are dropped)
            self._cv.notify_all()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def restart(self) -> None:
        """Come back on the same port from the start-up checkpoint (a real restart forgets synced weights)."""
        with self._cv:
            self._cv.wait_for(lambda: self._generating == 0)
        if self.model_path != self.startup_dir:
            self._load_dir(self.startup_dir)
        self.model_path, self.weight_version = self.startup_dir, "default"
        self.crashed = False
        self.start()

    def close(self) -> None:
        self.crash()
        self.engine.close()

    # ------------------------------------------------------------------ endpoints
    def generate(self, body: dict[str, Any]) -> Any:
        ids = body.get("input_ids")
        if body.get("text") is not None or ids is None:
            raise _BadRequest("the stand-in takes input_ids only (no text prompts)")
        if body.get("stream"):
            raise _BadRequest("the stand-in does not stream")
        if not ids:
            raise _BadRequest("input_ids cannot be empty.")
        single = isinstance(ids[0], int)
        prompts = [ids] if single else ids
        sps = body.get("sampling_params") or {}
        sps = [sps] * len(prompts) if isinstance(sps, dict) else sps
        if len(sps) != len(prompts):
            raise _BadRequest("the number of sampling_params should equal the batch size")
        n = int(sps[0].get("n", 1) or 1)
        if any(int(sp.get("n", 1) or 1) != n for sp in sps):
            raise _BadRequest("The parallel_sample_num should be the same for all samples in sample params.")
        for sp in sps:
            unknown = set(sp) - _SAMPLING_KEYS
            if unknown:
                raise _BadRequest(f"unexpected sampling_params {sorted(unknown)}")
            if sp.get("ignore_eos") or sp.get("min_new_tokens") or sp.get("stop"):
                raise _BadRequest("the stand-in does not implement ignore_eos, min_new_tokens or stop strings")
            if not self.original_logprob and float(sp.get("temperature", 1.0)) != 1.0:
                raise _BadRequest("the stand-in returns original log-probs only (SGLANG_RETURN_ORIGINAL_LOGPROB=1)")
        rid = body.get("rid") or uuid.uuid4().hex
        # rids as SGLang assigns them: a single request keeps its rid; batch items get rid_i; n > 1 copies
        # get fresh ids (TokenizerManager regenerates them), so the parent rid cannot abort them.
        if single and n == 1:
            rids = [rid]
        elif n == 1:
            rids = rid if isinstance(rid, list) else [f"{rid}_{i}" for i in range(len(prompts))]
        else:
            rids = [uuid.uuid4().hex for _ in range(len(prompts) * n)]
        items = [(p, sp) for p, sp in zip(prompts, sps, strict=True) for _ in range(n)]
        with self._cv:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self._live.update(rids)  # abortable while it waits (SGLang's waiting queue)
            self._cv.wait_for(lambda: not self.paused and not self._updating)
            self._generating += 1
        try:
            outs = self._run(items, rids)
        finally:
            with self._cv:
                self.active -= 1
                self._generating -= 1
                self._live.difference_update(rids)
                self._aborts.difference_update(rids)
                self._cv.notify_all()
        return outs[0] if single and n == 1 else outs

    def _run(self, items: list[tuple[list[int], dict[str, Any]]], rids: list[str]) -> list[dict[str, Any]]:
        from unirl.api import Sample, SamplingParams

        received = time.time()  # SGLang's created_time: when the TokenizerManager got the request
        outs: list[dict[str, Any] | None] = [None] * len(items)
        # one engine job per distinct sampling setting (a request normally has one)
        jobs: dict[tuple, list[int]] = {}
        for k, (_, sp) in enumerate(items):
            key = (float(sp.get("temperature", 1.0)), float(sp.get("top_p", 1.0)), int(sp.get("top_k", -1)),
                   int(sp.get("max_new_tokens", 128)), tuple(sp.get("stop_token_ids") or ()))
            jobs.setdefault(key, []).append(k)
        for (temp, top_p, top_k, max_new, stops), idx in jobs.items():
            sampling = SamplingParams(max_new_tokens=max_new, temperature=temp, top_p=top_p,
                                      top_k=top_k if top_k > 0 else 0, stop_token_ids=stops)
            samples = [Sample(id=f"{rids[k]}", prompt_ids=list(items[k][0]), seed=items[k][1].get("sampling_seed"))
                       for k in idx]
            handle = self.engine.submit(samples, sampling)
            waiting = {s.id for s in samples}
            while waiting:
                if self._aborts & waiting:
                    self.engine.abort(handle)
                    break
                for s in self.engine.poll(handle, timeout=0.02):
                    waiting.discard(s.id)
            for k, s in zip(idx, samples, strict=True):
                outs[k] = self._output(s, items[k][0], received)
        return [o for o in outs if o is not None]

    def _output(self, s: Any, prompt: list[int], received: float) -> dict[str, Any]:
        """One item's answer. ``e2e_latency`` is this item's own finish (the engine's per-row stamp)
        minus ``received``, as SGLang's TokenizerManager computes it per item; with ``enable_metrics``
        also the wall-clock timestamps SGLang's ``_calculate_timing_metrics`` adds."""
        rec = s.requests[-1]
        finished = rec.finished_ms / 1000.0 if rec.finished_ms > 0 else time.time()
        ids = list(s.response_ids)
        if s.finish_reason == "stop":
            reason: dict[str, Any] = {"type": "stop", "matched": ids[-1] if ids else None}
        elif s.finish_reason == "abort":
            reason = {"type": "abort", "message": "Abort before prefill" if not ids else "Abort in waiting queue"}
        else:
            reason = {"type": "length", "length": len(ids)}
        meta = {"id": s.id, "finish_reason": reason, "prompt_tokens": len(prompt),
                "completion_tokens": len(ids), "cached_tokens": 0,
                "weight_version": self.weight_version, "e2e_latency": max(0.0, finished - received),
                "output_token_logprobs": [[float(lp), int(t), None]
                                          for lp, t in zip(s.rollout_logprobs, ids, strict=True)]}
        if self.enable_metrics:
            meta["request_received_ts"] = received
            meta["decode_finished_ts"] = finished
            if rec.first_token_ms > 0:
                meta["prefill_finished_ts"] = rec.first_token_ms / 1000.0
        return {"text": s.response_text, "output_ids": ids, "meta_info": meta}

    def update_weights_from_disk(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        path = body.get("model_path")
        with self._cv:
            self._updating = True  # new generations wait; running ones finish first
            self._cv.wait_for(lambda: self._generating == 0)
        try:
            if self.fail_next_update:
                why, self.fail_next_update = self.fail_next_update, None
                raise RuntimeError(why)
            self._load_dir(str(path))
        except Exception as exc:  # noqa: BLE001 - SGLang reports and rolls back
            return 400, {"success": False, "num_paused_requests": 0,
                         "message": f"Failed to update weights: {exc}.\nRolling back to original weights."}
        finally:
            with self._cv:
                self._updating = False
                self._cv.notify_all()
        self.model_path = str(path)
        msg = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
            msg += f" Weight version updated to {self.weight_version}."
        return 200, {"success": True, "message": msg, "num_paused_requests": 0}

    def _load_dir(self, path: str) -> None:
        """Every tensor read and checked (names, shapes, dtype, completeness) before the model is touched."""
        import torch
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        named: list[tuple[str, torch.Tensor]] = []
        for f in files:
            named.extend((n, t.to(self.engine.dtype)) for n, t in load_file(str(f)).items())
        self._loads += 1
        self.engine.load_weights(named, self._loads)

    def flush_cache(self) -> tuple[int, str]:
        with self._cv:
            busy = self._generating > 0
        text = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                "requests, the operation will not be performed.)\n")
        return (400 if busy else 200), text

    def pause(self, paused: bool) -> dict[str, Any]:
        with self._cv:
            self.paused = paused
            self._cv.notify_all()
        word = "paused" if paused else "continued"
        return {"message": f"Generation {word} successfully.", "status": "ok"}

    def abort_request(self, body: dict[str, Any]) -> None:
        with self._cv:
            if body.get("abort_all"):
                self._aborts.update(self._live)
            elif body.get("rid") in self._live:
                self._aborts.add(body["rid"])
            self.log.append(("/abort_request", body))

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.startup_dir, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version}


class _Handler(BaseHTTPRequestHandler):
    standin: StandIn

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _reply(self, status: int, payload: Any) -> None:
        if self.standin.crashed or self.standin.epoch != self._epoch:  # a killed server answers nothing
            self.close_connection = True
            return
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        return json.loads(raw) if raw else {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._route("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._route("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._route("PUT")

    def _route(self, method: str) -> None:
        s = self.standin
        self._epoch = s.epoch
        path = self.path.split("?")[0]
        try:
            body = self._body() if method != "GET" else {}
        except ValueError as exc:
            self._reply(400, {"object": "error", "message": f"bad JSON: {exc}", "code": 400})
            return
        if path != "/abort_request":  # an abort is logged once it took effect (abort_request), so a test that
            s.log.append((path, body))  # waits for it in the log never races the abort itself
        try:
            if path in ("/health", "/health_generate"):
                self._reply(200, "")
            elif path == "/get_model_info":
                self._reply(200, s.model_info())
            elif path == "/get_weight_version":
                self._reply(200, {"weight_version": s.weight_version})
            elif path == "/generate" and method in ("POST", "PUT"):
                self._reply(200, s.generate(body))
            elif path == "/update_weights_from_disk" and method == "POST":
                self._reply(*s.update_weights_from_disk(body))
            elif path == "/flush_cache":
                self._reply(*s.flush_cache())
            elif path == "/pause_generation" and method == "POST":
                self._reply(200, s.pause(True))
            elif path == "/continue_generation" and method == "POST":
                self._reply(200, s.pause(False))
            elif path == "/abort_request" and method == "POST":
                s.abort_request(body)
                self._reply(200, "")
            elif path in ("/init_weights_update_group", "/update_weights_from_distributed"):
                self._reply(400, {"success": False, "message": "stand-in: no NCCL weight-update group on this machine"})
            else:
                self._reply(404, {"detail": "Not Found"})
        except _BadRequest as exc:
            self._reply(400, {"object": "error", "message": str(exc), "type": "Bad Request", "code": 400})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--enable-metrics", action="store_true")
    args, _unknown = parser.parse_known_args()  # the rest of sglang.launch_server's flags
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    original = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "1").lower() in ("1", "true")
    dtype = "float32" if args.dtype == "auto" else args.dtype
    server = StandIn(args.model_path, args.host, args.port, dtype=dtype, original_logprob=original,
                     enable_metrics=args.enable_metrics)
    print(f"stand-in SGLang server on {server.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.close()


if __name__ == "__main__":
    main()
