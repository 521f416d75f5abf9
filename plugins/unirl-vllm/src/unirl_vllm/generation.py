"""One submission's generation on the vLLM replicas, in four steps the engine's ``_run`` calls in turn.

* :func:`build_requests`: one plain-data vLLM request per sample whose response budget is not spent;
* :meth:`Generation.dispatch`: spread the requests over the replicas by load (:func:`assign`) and
  start them;
* :meth:`Generation.step`: one engine step on every busy replica, absorbing what each request gained
  (tokens, log-probs, text, its first-token and finishing step's times);
* :meth:`Generation.abort` on ``should_stop()``, which keeps the partial turns, and
  :meth:`Generation.abort_after_failure` when a step raised, which frees vLLM's requests and leaves the
  error to the caller.

Why a module of its own: the engine (:mod:`unirl_vllm.engine`) keeps the trainer's contract and the
weight sync; the bookkeeping of requests in flight is this, and it reads on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from unirl.api import Sample, SamplingParams, now_ms
from unirl_vllm.multimodal import check_prompt_len, multi_modal_data
from unirl_vllm.replicas import call_failures


@dataclass
class Pending:
    """One request in flight: what vLLM returned for it so far."""

    sample: Sample
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    routes: Any = None  # R3: the turn's expert ids from the host, [tokens, layers, k] (unirl_vllm.routing)


def build_requests(samples: list[Sample], sampling: SamplingParams, *, ignore_eos: bool,
                   eos_ids: Callable[[], set[int]],
                   ids: Iterator[int]) -> tuple[list[dict[str, Any]], list[Sample]]:
    """The vLLM requests for ``samples`` (each carrying its sample under ``_sample``), and the samples
    whose response budget is already spent (an empty turn, no vLLM request).

    Each request continues its sample from its whole context with the sample's own turn seed, and carries
    its prompt's images (``images``: vLLM's ``multi_modal_data``, or None; the host sends such a context
    with one placeholder per image, :func:`unirl_vllm.multimodal.placeholder_prompt`). vLLM
    stops at a listed stop id even with ``ignore_eos``, so under ``ignore_eos`` the eos ids the trainer
    lists are left out of ``stop_token_ids``."""
    eos = eos_ids() if ignore_eos else set()
    stop_ids = tuple(i for i in sampling.stop_token_ids if i not in eos)
    requests: list[dict[str, Any]] = []
    spent: list[Sample] = []
    for s in samples:
        limit = sampling.new_token_limit(s)
        if limit <= 0:
            spent.append(s)
            continue
        requests.append({
            "id": f"{s.id}#{s.turns}#{next(ids)}", "prompt_ids": s.context_ids, "max_tokens": limit,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "seed": s.turn_seed(), "stop_token_ids": stop_ids, "stop": sampling.stop,
            "ignore_eos": ignore_eos, "min_tokens": min(sampling.min_new_tokens, limit),
            "images": multi_modal_data(s), "_sample": s,
        })
    return requests, spent


def assign(costs: list[int], replicas: int) -> list[int]:
    """Replica of each request, spreading load: longest first, each to the least-loaded replica
    (load = prompt + token budget already assigned in this batch)."""
    load = [0] * replicas
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        r = min(range(len(load)), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += costs[i]
    return out


class Generation:
    """The requests of one submission in flight on the replicas, per replica by request id.

    ``call`` runs ``(replica, method, args)`` calls (:func:`unirl_vllm.replicas.call_all` over the
    engine's hosts); ``finish(pending, reason)`` ends a turn; ``served(tokens)`` counts the tokens a
    finished request put into vLLM's prefix cache (the engine's ``cache_tokens``)."""

    def __init__(self, hosts: list[Any], call: Callable[[list[tuple[int, str, tuple]]], list[Any]],
                 finish: Callable[[Pending, str], None], served: Callable[[int], None]) -> None:
        self.hosts, self.call, self.finish, self.served = hosts, call, finish, served
        self.live: list[dict[str, Pending]] = [{} for _ in hosts]
        self.busy: list[int] = []

    def __bool__(self) -> bool:
        """Whether any request is still in flight."""
        return any(self.live)

    def dispatch(self, requests: list[dict[str, Any]]) -> None:
        """Assign each request a replica (recorded on the sample's request record when there are
        several) and start each replica's share, all replicas at once."""
        where = assign([len(r["prompt_ids"]) + r["max_tokens"] for r in requests], len(self.hosts))
        per_host: list[list[dict[str, Any]]] = [[] for _ in self.hosts]
        for r, h in zip(requests, where, strict=True):
            s = r.pop("_sample")
            self.live[h][r["id"]] = Pending(s)
            if len(self.hosts) > 1:
                s.requests[-1].worker = str(h)
            per_host[h].append(r)
        self.busy = [h for h in range(len(self.hosts)) if per_host[h]]
        self.call([(h, "start", (per_host[h],)) for h in self.busy])

    def step(self) -> None:
        """One engine step on every replica with requests left; absorb what each request gained."""
        active = [h for h in self.busy if self.live[h]]
        outs = self.call([(h, "step", ()) for h in active])
        t = now_ms()
        for h, host_outs in zip(active, outs, strict=True):
            self.absorb(h, host_outs, t)

    def absorb(self, h: int, host_outs: list[dict[str, Any]], t: int) -> None:
        """Replica ``h``'s step outputs into its pending requests; a finished request ends its turn.

        A replica that returned nothing while requests are pending is asked whether vLLM still holds
        any: if not, it dropped them, and waiting would never end."""
        part = self.live[h]
        for out in host_outs:
            p = part.get(out["id"])
            if p is None:
                continue
            if out.get("prompt_len"):  # vLLM's own expansion of the image placeholders (unirl_vllm.multimodal)
                check_prompt_len(p.sample.id, len(p.sample.context_ids), out["prompt_len"])
            rec = p.sample.requests[-1]
            at = out.get("at_ms") or t  # the host's step time (see Host.step)
            if out["token_ids"] and not rec.first_token_ms:
                rec.first_token_ms = at
            if out["finish_reason"] is not None:
                rec.finished_ms = at  # this request's own finishing step, not the job's end
                if out.get("cached_tokens") is not None:
                    rec.cached_tokens = int(out["cached_tokens"])
            p.token_ids.extend(out["token_ids"])
            p.logprobs.extend(out["logprobs"])
            p.text += out["text"]
            if out.get("routes") is not None:
                p.routes = out["routes"]
            if out["finish_reason"] is not None:
                self.served(len(p.sample.context_ids) + len(p.token_ids))
                del part[out["id"]]
                self.finish(p, out["finish_reason"])
        if part and not host_outs and not self.call([(h, "unfinished", ())])[0]:
            raise RuntimeError(f"vLLM replica {h} dropped {len(part)} request(s) without finishing "
                               f"them: {sorted(part)[:3]}")

    def abort(self) -> None:
        """Stop now: abort what is left on every replica and end each turn with its partial tokens."""
        self.call([(h, "abort_requests", (list(self.live[h]),)) for h in self.busy if self.live[h]])
        for part in self.live:
            for p in part.values():
                self.finish(p, "abort")
            part.clear()

    def abort_after_failure(self, error: BaseException) -> None:
        """Free vLLM's requests after ``error`` ended the generation; the caller re-raises ``error``.

        An abort that fails here fails for the replica's own reason (:func:`call_failures`: it died,
        or vLLM's engine did), which usually is ``error``'s cause too: it is noted on ``error`` rather
        than raised over it, and the next replica is still aborted."""
        failures = call_failures(self.hosts)
        for h in self.busy:
            if self.live[h]:
                try:
                    self.call([(h, "abort_requests", (list(self.live[h]),))])
                except failures as exc:
                    error.add_note(f"aborting replica {h}'s {len(self.live[h])} request(s) also failed: "
                                   f"{type(exc).__name__}: {exc}")
