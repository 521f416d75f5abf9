"""MoE routing diagnostics keyed by token prefix: the engine's top-k expert ids, per sampled token.

Why a prefix key: neither engine exposes its routing by request, and a row of an engine forward
(vLLM's flattened batch, the embedded engine's left-padded batch after finished rows were dropped)
is not a sample's token without the engine's schedule. But a causal model's routing at input
position ``p`` depends only on the tokens ``seq[:p+1]``: so the engine side files the ids of every
row that produced a sampled token under a rolling hash of that prefix (:func:`roll`), and the
trainer looks each response token up by the same hash of its own sequence. Siblings of a GRPO group
share their prompt, so the prompt's last row is filed once and found by all of them (under parity
routing is batch-invariant: equal prefixes route equally wherever they sat in the batch).

* Engine side, :data:`SINK`: the embedded engine (``unirl_parity_vllm.moe``, in the trainer's
  process) files into memory; vLLM's worker (``vllm_side.moe``) files into memory too when it runs in
  the trainer's process, and appends pickled records to ``<parity dir>/routing/<pid>.pkl`` when
  ``UNIRL_PARITY_DIR`` is set (EngineCore / worker / Ray processes: the file is the only way out).
* Trainer side, :func:`attach` (``unirl_on_rollout``): every rollout sample gets
  ``meta["parity_routing"]``: per response token, the engine's ``[layers][k]`` ids, or None where no
  record exists (a token the policy did not choose, or an engine that recorded nothing).
* The gate (:func:`compare`) holds them against the replay's routing of the same micro-batch.
"""

from __future__ import annotations

import os
import pickle
import threading
from pathlib import Path
from typing import Any

#: Mersenne prime modulus and multiplier of the prefix hash
MOD = (1 << 61) - 1
MUL = 1_000_003
META_KEY = "parity_routing"
#: how many :func:`attach` calls a record survives unclaimed (async rollouts may straddle one call)
KEEP_CALLS = 3


def roll(h: int, token: int) -> int:
    """The prefix hash extended by one token (``h = 0`` before the first token)."""
    return (h * MUL + int(token) + 1) % MOD


def prefix_keys(tokens: list[int]) -> list[int]:
    """``keys[p]``: the hash of ``tokens[:p+1]``."""
    out, h = [], 0
    for t in tokens:
        h = roll(h, t)
        out.append(h)
    return out


class Sink:
    """Engine-side: ``prefix hash -> ids [layers, k]`` (uint8/int16 numpy), to memory or a file."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.memory: dict[int, Any] = {}
        self._file = None
        self._path: Path | None = None

    def add(self, keys: list[int], ids: Any) -> None:
        """``ids``: a ``[rows, layers, k]`` tensor, one row per key."""
        import numpy as np

        arr = ids.detach().to("cpu").numpy()
        arr = arr.astype(np.uint8 if arr.size == 0 or int(arr.max()) < 256 else np.int16)
        rec = {int(k): arr[i] for i, k in enumerate(keys)}
        directory = os.environ.get("UNIRL_PARITY_DIR")
        with self._lock:
            if not directory:
                self.memory.update(rec)
                return
            path = Path(directory) / "routing" / f"{os.getpid()}.pkl"
            if self._path != path:
                path.parent.mkdir(parents=True, exist_ok=True)
                if self._file is not None:
                    self._file.close()
                self._file, self._path = open(path, "ab"), path  # noqa: SIM115 - held for the process
            pickle.dump(rec, self._file, protocol=pickle.HIGHEST_PROTOCOL)
            self._file.flush()

    def take(self) -> dict[int, Any]:
        with self._lock:
            out, self.memory = self.memory, {}
        return out


SINK = Sink()


class Reader:
    """Trainer-side: every record filed so far (memory and files), each kept for :data:`KEEP_CALLS`."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.offsets: dict[Path, int] = {}
        self.records: dict[int, tuple[int, Any]] = {}
        self.calls = 0

    def refresh(self) -> None:
        self.calls += 1
        fresh = SINK.take()
        for path in sorted((self.dir / "routing").glob("*.pkl")):
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                while True:
                    at = f.tell()
                    try:
                        fresh.update(pickle.load(f))
                    except (EOFError, pickle.UnpicklingError, ValueError):
                        f.seek(at)  # the end, or a record being appended right now: read it next time
                        break
                self.offsets[path] = f.tell()
        for k, v in fresh.items():
            self.records[k] = (self.calls, v)
        old = [k for k, (c, _) in self.records.items() if c <= self.calls - KEEP_CALLS]
        for k in old:
            del self.records[k]

    def lookup(self, key: int) -> Any:
        hit = self.records.get(key)
        return None if hit is None else hit[1]


_READERS: dict[str, Reader] = {}


def reader(config: Any) -> Reader:
    from unirl_parity_vllm.paths import parity_dir

    d = parity_dir(config)
    r = _READERS.get(str(d))
    if r is None:
        r = _READERS[str(d)] = Reader(d)
    return r


def reset(config: Any) -> None:
    """A fresh run in this parity dir: forget what was filed before it (records already in the files
    are skipped, not deleted: an engine process may hold its file open for appending)."""
    from unirl_parity_vllm.paths import parity_dir

    d = parity_dir(config)
    r = _READERS[str(d)] = Reader(d)
    r.offsets = {p: p.stat().st_size for p in (d / "routing").glob("*.pkl")}
    SINK.take()


def attach(samples: Any, config: Any) -> dict[str, int]:
    """Put the engine's routing of every response token on ``meta["parity_routing"]`` (module doc)."""
    rd = reader(config)
    rd.refresh()
    found = missing = 0
    if not rd.records:  # a dense model (or an engine that records nothing): nothing to attach
        return {"found": 0, "missing": 0}
    for s in samples:
        resp = list(s.response_ids)
        if not resp:
            continue
        keys = prefix_keys(list(s.prompt_ids) + resp)
        p = len(s.prompt_ids)
        lm = list(s.loss_mask) if s.loss_mask else [1] * len(resp)
        per: list[Any] = []
        for i, m in enumerate(lm):
            ids = rd.lookup(keys[p + i - 1]) if m else None
            if m:
                found, missing = (found + 1, missing) if ids is not None else (found, missing + 1)
            per.append(None if ids is None else ids.tolist())
        s.meta[META_KEY] = per
    return {"found": found, "missing": missing}


def compare(samples: list[Any], replay: dict[int, Any], num_experts: int,
            num_layers: int | None = None) -> dict[str, Any] | None:
    """The gate's routing numbers for one micro-batch: ``replay`` is the packed forward's
    ``layer -> ids [rows, k]`` (its rows in :func:`unirl.packing.pack` order). Counts, not fractions,
    so ranks and micro-batches add up: ``tokens`` (loss tokens with an engine record),
    ``mismatch_tokens`` (top-k *set* differs in any layer), ``missing`` (loss tokens without one),
    ``load`` (per layer, the replay's (token, slot) assignments per expert over the loss tokens).
    None when ``replay`` does not cover this micro-batch's packed rows."""
    import torch

    if not replay:
        return None
    layers = sorted(replay)
    if num_layers is None:
        num_layers = next((len(x) for s in samples for x in s.meta.get(META_KEY) or [] if x is not None), None)
    if num_layers is not None:
        layers = layers[:num_layers]  # a reference model's forward comes after the policy's
    total = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    if any(replay[layer].shape[0] != total for layer in layers):
        return None
    rows, engine, have, off = [], [], [], 0
    for s in samples:
        p, r = len(s.prompt_ids), len(s.response_ids)
        lm = list(s.loss_mask) if s.loss_mask else [1] * r
        eng = s.meta.get(META_KEY) or [None] * r
        for i in range(r):
            if lm[i]:
                rows.append(off + p - 1 + i)
                e = eng[i] if i < len(eng) else None
                have.append(e is not None and len(e) == len(layers))
                engine.append(e if have[-1] else None)
        off += p + r
    idx = torch.tensor(rows, dtype=torch.long)
    rep = torch.stack([replay[layer][idx] for layer in layers], dim=1) if rows else torch.zeros(0, len(layers), 1)
    k = rep.shape[-1]
    load = {}
    for j in range(len(layers)):
        load[str(j)] = torch.bincount(rep[:, j].reshape(-1), minlength=num_experts).tolist()
    hv = torch.tensor(have, dtype=torch.bool)
    bad = 0
    if bool(hv.any()):
        eng_t = torch.tensor([e for e in engine if e is not None], dtype=torch.long).reshape(-1, len(layers), k)
        bad = int((eng_t.sort(-1).values != rep[hv].sort(-1).values).any(-1).any(-1).sum())
    return {"tokens": int(hv.sum()), "mismatch_tokens": bad, "missing": int((~hv).sum()), "load": load}


def merge(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Sum two :func:`compare` results (load vectors padded to the longer)."""
    if a is None or b is None:
        return a if b is None else (b if a is None else None)
    load = dict(a["load"])
    for layer, v in b["load"].items():
        w = load.get(layer, [])
        n = max(len(v), len(w))
        load[layer] = [(w[i] if i < len(w) else 0) + (v[i] if i < len(v) else 0) for i in range(n)]
    return {"tokens": a["tokens"] + b["tokens"], "mismatch_tokens": a["mismatch_tokens"] + b["mismatch_tokens"],
            "missing": a["missing"] + b["missing"], "load": load}


def summary(r: dict[str, Any] | None, num_experts: int | None = None) -> dict[str, Any] | None:
    """Counts -> the artifact's view: mismatch fraction, expert load per layer as fractions, and each
    layer's max load relative to uniform (1.0 = perfectly balanced)."""
    if r is None:
        return None
    load = {}
    imbalance = {}
    for layer, counts in sorted(r["load"].items(), key=lambda kv: int(kv[0])):
        n = len(counts) if num_experts is None else max(num_experts, len(counts))
        c = list(counts) + [0] * (n - len(counts))
        tot = sum(c) or 1
        load[layer] = [round(x / tot, 6) for x in c]
        imbalance[layer] = round(max(c) * n / tot, 6) if sum(c) else 0.0
    n = r["tokens"]
    return {"tokens": n, "mismatch_tokens": r["mismatch_tokens"], "missing": r["missing"],
            "mismatch_fraction": r["mismatch_tokens"] / n if n else None, "expert_load": load,
            "max_load_vs_uniform": imbalance}
