"""The embedded rollout engine: batched sampling with a KV cache on a private copy of the weights.

Two forward paths share one sampling loop:

* **fast** (default, for Qwen3 / Qwen2 / Llama-shaped decoders): an incremental forward written
  directly over the transformers modules (same RMSNorm, projections, RoPE and MLP modules, so the
  weights are the model's own parameters), with a preallocated static KV cache, boolean masks for
  left padding and the final norm + lm_head applied to the last position only. It skips
  ``generate``'s and the model forward's per-step bookkeeping, which dominates at small sizes.
* **hf**: the model's own forward with a ``DynamicCache``, ``attention_mask`` and ``position_ids``;
  used for any other architecture (or with ``rollout.options.fast_path: false``).

Sampling is vectorised over the batch and keyed per row: every row carries a 63-bit seed (the
sample's ``seed``, or one drawn from the engine's own generator), and the Gumbel noise for step ``t``
of that row is a counter-based hash of ``(seed, t, token id)``. A seeded sample therefore draws the
same tokens alone or in any batch, with no per-row Python loop.

Log-probs are ``log_softmax`` of the *raw* fp32 logits (before temperature, top-k, top-p) of the
sampled token, which is what a teacher-forced replay computes.
"""

from __future__ import annotations

import copy
import math
import sys
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from unirl.contracts import ModelAdapter, Receipt, RolloutEngine, SamplingParams, fingerprint
from unirl.kernel.errors import ConfigError
from unirl.samples import Sample

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.config import RunConfig

_FAST_MODEL_TYPES = ("qwen3", "qwen2", "llama")


class TorchEngineConfig(BaseModel):
    """``rollout.options`` of the ``torch`` engine."""

    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(64, ge=1, description="most sequences per forward; larger requests are chunked")
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="engine weight dtype; None follows model.dtype"
    )
    fast_path: bool = Field(True, description="use the built-in incremental decoder for known architectures")
    seed: int | None = Field(None, description="seeds the draws for samples without a seed; None uses run.seed")


# ------------------------------------------------------------------------------ counter-based RNG

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)


def _i64(v: int) -> int:
    """``v`` modulo 2**64 as a signed int64 value."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps modulo 2**64)."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def gumbel_noise(seeds: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise of shape ``[rows, vocab]``; row r depends only on ``(seeds[r], step)``."""
    import torch

    key = _mix64(_mix64(seeds) + _i64((step + 1) * _GAMMA))  # [B]
    idx = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device) * _GAMMA
    h = _mix64(key[:, None] + idx[None, :])
    u = (_shr(h, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    return -torch.log(-torch.log(u))


def sample_tokens(logits: torch.Tensor, sampling: SamplingParams, seeds: torch.Tensor, step: int) -> torch.Tensor:
    """Pick one token per row from fp32 ``logits [B, V]`` under temperature / top-k / top-p."""
    import torch

    if sampling.temperature == 0:
        return logits.argmax(-1)
    x = logits / sampling.temperature
    vocab = x.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if sampling.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) > sampling.top_p
        drop[:, 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -math.inf)
    return (x + gumbel_noise(seeds, step, vocab)).argmax(-1)


# ------------------------------------------------------------------------------------ the engine


class TorchEngine(RolloutEngine):
    """Embedded engine: one process, one private copy of the model, eval mode, no autograd."""

    Config = TorchEngineConfig

    def __init__(self, *, config: RunConfig, adapter: ModelAdapter, tokenizer: Any = None, model: Any = None):
        import torch

        try:
            self.options = TorchEngineConfig.model_validate(dict(config.rollout.options))
        except ValidationError as exc:
            msgs = "; ".join(
                f"rollout.options.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
            )
            raise ConfigError(f"invalid options for rollout engine 'torch': {msgs}") from None
        self.config = config
        self.adapter = adapter
        self.tokenizer = tokenizer if tokenizer is not None else adapter.build_tokenizer(config)
        if model is None:
            model = adapter.build_model(config, self.tokenizer)
        else:
            model = copy.deepcopy(model)  # the engine never aliases the caller's (the actor's) tensors
        dtype = getattr(torch, self.options.dtype or config.model.dtype)
        self.model = model.to(dtype).eval().requires_grad_(False)
        self.dtype = dtype
        self.device = next(self.model.parameters()).device
        self.weight_version = 0
        self._lock = threading.Lock()
        seed = self.options.seed if self.options.seed is not None else config.run.seed
        self._generator = torch.Generator().manual_seed(seed)
        self.fast = self.options.fast_path and self._fast_supported()
        self.eos_ids = self._eos_ids()
        self.pad_id = self._pad_id()

    # ------------------------------------------------------------------ setup helpers
    def _fast_supported(self) -> bool:
        m = self.model
        cfg = getattr(m, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in _FAST_MODEL_TYPES:
            return False
        if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager", None):
            return False
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
            return False
        inner = getattr(m, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or not all(hasattr(inner, n) for n in needed) or not hasattr(m, "lm_head"):
            return False
        for layer in inner.layers:
            a = getattr(layer, "self_attn", None)
            if a is None or not all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
                return False
            if not all(hasattr(layer, n) for n in ("mlp", "input_layernorm", "post_attention_layernorm")):
                return False
            if getattr(a, "sliding_window", None):
                return False
        self._rope = getattr(sys.modules[type(inner.layers[0].self_attn).__module__], "apply_rotary_pos_emb", None)
        return self._rope is not None

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.tokenizer, getattr(self.model, "generation_config", None), self.model.config):
            v = getattr(source, "eos_token_id", None)
            if v is None:
                continue
            ids.update([v] if isinstance(v, int) else list(v))
        return ids

    def _pad_id(self) -> int:
        for v in (getattr(self.tokenizer, "pad_token_id", None), getattr(self.model.config, "pad_token_id", None)):
            if isinstance(v, int):
                return v
        return min(self.eos_ids) if self.eos_ids else 0

    # ------------------------------------------------------------------ generation
    def generate(self, samples: list[Sample], sampling: SamplingParams) -> list[Sample]:
        import torch

        if not samples:
            return samples
        for s in samples:
            if not s.prompt_ids:
                raise ValueError(f"sample {s.id}: empty prompt_ids (nothing to condition on)")
        # one draw per sample in order, so unseeded runs are reproducible for a given engine seed
        drawn = torch.randint(0, 1 << 62, (len(samples),), generator=self._generator).tolist()
        seeds = [s.seed if s.seed is not None else d for s, d in zip(samples, drawn, strict=True)]
        stop_ids = self.eos_ids | set(sampling.stop_token_ids)
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long)
        # chunk by prompt length so rows of a forward have similar padding; results go back in order
        order = sorted(range(len(samples)), key=lambda i: (len(samples[i].prompt_ids), i))
        size = self.options.batch_size
        with self._lock, torch.inference_mode():
            version = self.weight_version
            for c in range(0, len(order), size):
                idx = order[c : c + size]
                toks, lps = self._generate_batch(
                    [samples[i].prompt_ids for i in idx], [seeds[i] for i in idx], sampling, stop
                )
                for i, t, lp in zip(idx, toks, lps, strict=True):
                    self._fill(samples[i], t, lp, version, stop_ids)
        return samples

    def _fill(self, s: Sample, toks: list[int], lps: list[float], version: int, stop: set[int]) -> None:
        stopped = bool(toks) and toks[-1] in stop
        s.response_ids = toks
        s.loss_mask = [1] * len(toks)
        s.rollout_logprobs = lps
        s.versions = [version] * len(toks)
        s.finish_reason = "stop" if stopped else "length"
        s.status = "ok" if stopped else "truncated"
        s.response_text = self.tokenizer.decode(toks[:-1] if stopped else toks, skip_special_tokens=True)

    def _generate_batch(self, prompts: list[list[int]], seeds: list[int], sampling: SamplingParams,
                        stop: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
        import torch

        B, N = len(prompts), sampling.max_new_tokens
        P = max(len(p) for p in prompts)
        dev = self.device
        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        valid = torch.zeros((B, P + N), dtype=torch.bool)
        for r, p in enumerate(prompts):
            ids[r, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            valid[r, P - len(p) :] = True  # generated positions are valid too (masked rows are ignored)
        ids, valid = ids.to(dev), valid.to(dev)
        plen = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev)
        pos = (valid[:, :P].long().cumsum(-1) - 1).clamp(min=0)
        seed_t = torch.tensor(seeds, dtype=torch.int64, device=dev)
        stop = stop.to(dev)

        out_tok = torch.full((B, N), self.pad_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros((B, N), dtype=torch.float32, device=dev)
        lengths = torch.full((B,), N, dtype=torch.long, device=dev)
        rows = torch.arange(B, device=dev)  # original row of each live row
        done = torch.zeros(B, dtype=torch.bool, device=dev)

        state = self._fast_prefill(ids, pos, valid, N) if self.fast else self._hf_prefill(ids, pos, valid)
        logits = state.pop("logits")
        for t in range(N):
            raw = logits.float()
            tok = sample_tokens(raw, sampling, seed_t, t)
            lp = torch.log_softmax(raw, dim=-1).gather(-1, tok[:, None])[:, 0]
            out_tok[rows, t] = tok
            out_lp[rows, t] = lp
            finished = torch.isin(tok, stop) & ~done
            if t + 1 == N:
                lengths[rows[finished]] = t + 1
                break
            if bool(finished.any()):
                lengths[rows[finished]] = t + 1
                done = done | finished
                live = ~done
                n_live = int(live.sum())
                if n_live == 0:
                    break
                if n_live <= 0.75 * live.numel():  # drop finished rows from the batch
                    keep = live.nonzero()[:, 0]
                    rows, seed_t, plen, done, tok = rows[keep], seed_t[keep], plen[keep], done[keep], tok[keep]
                    state = self._select(state, keep)
            step_pos = (plen + t)[:, None]
            logits = (self._fast_step if self.fast else self._hf_step)(state, tok[:, None], step_pos, P + t)

        lengths_l = lengths.tolist()
        toks = [out_tok[r, : lengths_l[r]].tolist() for r in range(B)]
        lps = [out_lp[r, : lengths_l[r]].tolist() for r in range(B)]
        return toks, lps

    # ------------------------------------------------------------------ fast path
    def _fast_prefill(self, ids, pos, valid, max_new: int) -> dict[str, Any]:
        import torch

        m, inner = self.model, self.model.model
        B, P = ids.shape
        cfg = m.config
        a0 = inner.layers[0].self_attn
        head_dim = a0.head_dim if hasattr(a0, "head_dim") else cfg.hidden_size // cfg.num_attention_heads
        kv = [
            (torch.empty((B, cfg.num_key_value_heads, P + max_new, head_dim), dtype=self.dtype, device=ids.device),
             torch.empty((B, cfg.num_key_value_heads, P + max_new, head_dim), dtype=self.dtype, device=ids.device))
            for _ in inner.layers
        ]
        causal = torch.ones((P, P), dtype=torch.bool, device=ids.device).tril()
        eye = torch.eye(P, dtype=torch.bool, device=ids.device)
        # pad queries attend to themselves only: no all-masked rows (NaN) anywhere in the cache
        mask = (causal[None] & valid[:, None, :P]) | eye[None]
        state = {"kv": kv, "valid": valid}
        state["logits"] = self._fast_forward(state, ids, pos, 0, mask[:, None])
        return state

    def _fast_step(self, state, tok, pos, start: int):
        import torch

        if "bias" not in state:  # additive mask over the cache for the decode attention
            bias = torch.zeros(state["valid"].shape, dtype=self.dtype, device=state["valid"].device)
            state["bias"] = bias.masked_fill(~state["valid"], -math.inf)[:, None, None, :]
        mask = state["bias"][..., : start + 1]
        return self._fast_forward(state, tok, pos, start, mask)

    def _fast_forward(self, state, ids, pos, start: int, mask):
        import torch
        import torch.nn.functional as F

        m, inner = self.model, self.model.model
        B, T = ids.shape
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, pos)
        end = start + T
        rope = self._rope
        for layer, (K, V) in zip(inner.layers, state["kv"], strict=True):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            shape = (B, T, -1, K.shape[-1])
            q = a.q_proj(x).view(shape)
            k = a.k_proj(x).view(shape)
            if hasattr(a, "q_norm"):
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = a.v_proj(x).view(shape).transpose(1, 2)
            q, k = rope(q, k, cos, sin)
            K[:, :, start:end] = k
            V[:, :, start:end] = v
            if T == 1:  # decode: grouped-query matmul attention, cheaper than sdpa's kernels at q_len 1
                Hkv = K.shape[1]
                qg = q.reshape(B, Hkv, -1, K.shape[-1])  # heads of one kv group are contiguous
                scores = torch.matmul(qg, K[:, :, :end].transpose(-1, -2)) * a.scaling + mask
                w = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qg.dtype)
                o = torch.matmul(w, V[:, :, :end]).reshape(B, -1, 1, K.shape[-1])
            else:
                o = F.scaled_dot_product_attention(
                    q, K[:, :, :end], V[:, :, :end], attn_mask=mask, scale=a.scaling,
                    enable_gqa=q.shape[1] != K.shape[1],
                )
            h = h + a.o_proj(o.transpose(1, 2).reshape(B, T, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return m.lm_head(inner.norm(h[:, -1]))

    # ------------------------------------------------------------------ transformers path
    def _hf_prefill(self, ids, pos, valid) -> dict[str, Any]:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        P = ids.shape[1]
        out = self.model(input_ids=ids, attention_mask=valid[:, :P].long(), position_ids=pos,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        return {"cache": out.past_key_values, "valid": valid, "logits": out.logits[:, -1]}

    def _hf_step(self, state, tok, pos, start: int):
        out = self.model(input_ids=tok, attention_mask=state["valid"][:, : start + 1].long(), position_ids=pos,
                         past_key_values=state["cache"], use_cache=True, logits_to_keep=1)
        state["cache"] = out.past_key_values
        return out.logits[:, -1]

    @staticmethod
    def _select(state: dict[str, Any], keep: torch.Tensor) -> dict[str, Any]:
        state["valid"] = state["valid"][keep]
        if "bias" in state:
            state["bias"] = state["bias"][keep]
        if "kv" in state:
            state["kv"] = [(K[keep], V[keep]) for K, V in state["kv"]]
        else:
            state["cache"].batch_select_indices(keep)
        return state

    # ------------------------------------------------------------------ weights
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> list[Receipt]:
        import torch

        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                f"TorchEngine.load_weights(version={version}) refused: a generation is in flight; "
                "pause rollouts before syncing weights"
            )
        try:
            t0 = time.perf_counter()
            received = list(named_tensors)
            targets = self._check(received)
            with torch.no_grad():
                for (_, src), dst in zip(received, targets, strict=True):
                    dst.copy_(src.detach().to(device=dst.device, dtype=dst.dtype))
            self.weight_version = version
            return [Receipt(worker=0, version=version, fingerprint=fingerprint(received),
                            num_tensors=len(received), seconds=time.perf_counter() - t0)]
        finally:
            self._lock.release()

    def _check(self, received: list[tuple[str, Any]]) -> list[torch.Tensor]:
        """Every problem is found before any tensor is touched, so a failed load changes nothing."""
        import torch

        state = self.model.state_dict(keep_vars=True)
        targets: list[torch.Tensor] = []
        seen: dict[int, tuple[str, torch.Tensor]] = {}  # storage -> (name, tensor): tied weights
        names: set[str] = set()
        for name, t in received:
            where = f"weight '{name}'"
            if name in names:
                raise ValueError(f"{where} appears twice in one update")
            names.add(name)
            if name not in state:
                close = [k for k in state if k.endswith(name.split(".")[-1])][:3]
                raise ValueError(f"{where} is not a parameter of the engine model (e.g. {close})")
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{where} is a {type(t).__name__}, not a tensor")
            dst = state[name].data
            if tuple(t.shape) != tuple(dst.shape):
                raise ValueError(f"{where} has shape {tuple(t.shape)}, the engine expects {tuple(dst.shape)}")
            if t.dtype != dst.dtype and not (t.is_floating_point() and dst.is_floating_point()):
                raise ValueError(f"{where} has dtype {t.dtype}, the engine expects {dst.dtype}")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"{where} holds non-finite values (NaN or inf)")
            key = dst.untyped_storage().data_ptr()
            if key in seen and not torch.equal(seen[key][1].to(dst.dtype), t.to(dst.dtype)):
                raise ValueError(f"{where} is tied to '{seen[key][0]}' but the update gives them different values")
            seen[key] = (name, t)
            targets.append(dst)
        return targets
