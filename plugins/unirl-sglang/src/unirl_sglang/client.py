"""One SGLang server over HTTP: JSON requests, a bounded number in flight, retries with backoff.

Stdlib only (``urllib``), so the plugin adds no HTTP dependency. Why retries are safe: every request
this plugin sends is idempotent. A ``/generate`` carries the sample's ``sampling_seed`` and a fresh
``rid`` per attempt, so a re-sent request samples the same tokens and nothing is applied twice (a
result is taken from the one attempt that answered). A weight update names a versioned directory
that never changes once written, so loading it twice is loading it once.

What is retried: connection refused / reset / closed without an answer, timeouts, and HTTP 502, 503
and 504 (a restarting server or a proxy in front of one). What is not: any other HTTP error (the
server answered; a 400 is the caller's bug or a refused update, and retrying cannot fix it).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from unirl.api import UniRLError

_RETRY_STATUS = (502, 503, 504)


class SGLangUnavailableError(UniRLError):
    """A server did not answer after every retry (it is down, restarting for too long, or unreachable)."""


class SGLangRequestError(UniRLError):
    """A server answered with an HTTP error (not retried): ``status`` and the server's ``body``."""

    def __init__(self, message: str, status: int, body: Any) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class SGLangServer:
    """Client of one server at ``url``. ``slots`` bounds concurrent ``/generate`` calls (the caller takes one)."""

    def __init__(self, url: str, index: int, *, max_concurrency: int, timeout_s: float, retries: int,
                 backoff_s: float, backoff_max_s: float) -> None:
        self.url = url.rstrip("/")
        self.index = index
        self.slots = threading.BoundedSemaphore(max_concurrency)
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s

    def __repr__(self) -> str:
        return f"SGLangServer({self.url})"

    def call(self, method: str, path: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None,
             retries: int | None = None) -> Any:
        """One request, retried on connection errors; returns the parsed JSON (or text) body."""
        attempts = 1 + (self.retries if retries is None else retries)
        t0 = time.monotonic()
        last: BaseException | None = None
        for attempt in range(attempts):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.backoff_max_s))
            try:
                return self._once(method, path, body, timeout_s or self.timeout_s)
            except SGLangRequestError as exc:
                if exc.status not in _RETRY_STATUS:
                    raise
                last = exc
            except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as exc:
                last = exc
        raise SGLangUnavailableError(
            f"SGLang server {self.url}: {method} {path} failed {attempts} time(s) over "
            f"{time.monotonic() - t0:.1f}s (last error: {type(last).__name__}: {last}). Is the server up? "
            "(rollout.options.servers / launch; rollout.options.retries and backoff_s set how long to wait)")

    def _once(self, method: str, path: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - operator-given URL
                return _parse(resp.read())
        except urllib.error.HTTPError as exc:
            payload = _parse(exc.read())
            raise SGLangRequestError(f"SGLang server {self.url}: {method} {path} -> HTTP {exc.code}: {payload}",
                                     exc.code, payload) from None

    def healthy(self, timeout_s: float) -> None:
        """Wait until ``GET /health_generate`` answers 200 (it runs a one-token generation), or raise."""
        deadline = time.monotonic() + timeout_s
        last: BaseException | None = None
        while True:
            try:
                self._once("GET", "/health_generate", None, min(30.0, timeout_s))
                return
            except (SGLangRequestError, urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as exc:
                last = exc
            if time.monotonic() >= deadline:
                raise SGLangUnavailableError(
                    f"SGLang server {self.url} is not healthy after {timeout_s:.0f}s: GET /health_generate -> "
                    f"{type(last).__name__}: {last} (rollout.options.health_timeout_s)")
            time.sleep(0.2)


def _parse(raw: bytes) -> Any:
    text = raw.decode("utf-8", "replace")
    try:
        return json.loads(text)
    except ValueError:
        return text
