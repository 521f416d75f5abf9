"""The embedded rollout engine: batched sampling with a KV cache on a private copy of the weights.

It is a :class:`~unirl.engine.queued.QueuedEngine`: the base owns submit / poll / abort / pause /
resume and the sync guard; this module owns :meth:`TorchEngine._run` (one model turn for a list of
samples) and weight loading.

Two forward paths share one sampling loop:

* **fast** (default, for Qwen3 / Qwen2 / Llama-shaped decoders): an incremental forward written
  directly over the transformers modules (same RMSNorm, projections, RoPE and MLP modules, so the
  weights are the model's own parameters), with a preallocated static KV cache, boolean masks for
  left padding and the final norm + lm_head applied to the last position only. It skips
  ``generate``'s and the model forward's per-step bookkeeping, which dominates at small sizes; for
  the same reason it computes fp32 RMSNorm as one fused call and RoPE on q and k at once, both the
  modules' exact bits (:func:`_rms_norm`, :func:`_rope_qk`), runs q/k/v and gate/up as one GEMM each
  (:meth:`TorchEngine._fuse_projections`), and prefills the rows of a group once
  (:meth:`TorchEngine._shared_prefill`). These two can change a logit in its last bit, since a GEMM's
  bits depend on its shape here.
* **hf**: the model's own forward with a ``DynamicCache``, ``attention_mask`` and ``position_ids``;
  used for any other architecture (or with ``rollout.options.fast_path: false``).

**Continuation.** A turn conditions on ``sample.context_ids`` (prompt + every earlier turn and
observation) and generates at most ``sampling.new_token_limit(sample)`` tokens (0: an empty turn,
finish "length").

**Seeds.** Sampling is vectorised over the batch and keyed per row: every row carries a 63-bit seed
(``sample.turn_seed()``, keyed on the request and its depth, or one drawn from the engine's own
generator for an unseeded sample), and the Gumbel noise for step ``t`` of that row is a
counter-based hash of ``(seed, t, token id)``. A seeded request therefore draws the same tokens alone,
in any batch, at any step, with no per-row Python loop.

**Stopping.** A row ends at a stop token id (the tokenizer's / model's eos plus
``sampling.stop_token_ids``) or when its decoded turn text contains a ``sampling.stop`` string.
``sampling.ignore_eos`` takes the eos ids out of that set; ``sampling.min_new_tokens`` sets the
logits of eos and the stop ids to -inf before the draw for the turn's first tokens (the log-prob is
still that of the raw logits, like vLLM's ``min_tokens``).
Nothing is trimmed from the tokens: the stop token, or the token that completed a stop string, is kept
(it is what the policy chose and is learnt), with its log-prob. The turn's text is the decode of its
tokens (``skip_special_tokens``) without a stop *token*'s text, and *with* a stop *string* (what vLLM
gives with ``include_stop_str_in_output``), so an environment that parses e.g. ``</tool>`` sees it.
Stop strings are checked only on rows whose new token can end one (its lone decode contains the last
character of a stop string, is a partial UTF-8 byte, or decodes to nothing): a vectorised lookup per
step, then a decode of the row's tail for those rows only.

**Abort.** ``should_stop()`` is read every decode step; when set, unfinished rows end with what they
have and ``finish_reason="abort"``.

**Parity.** When the runtime has an enabled parity provider, every generation runs inside
``runtime.exact("rollout")``, where the provider has installed its reference ops into the
transformers modules. The fast path keeps its static cache and last-position head, but its attention
then goes through each layer's own ``self_attn`` module (over :class:`_StaticCache`, with the boolean
mask transformers would pass), so the provider's attention runs instead of the fast path's private
kernels. Norms, MLPs and projections are module calls on both paths already. The **hf** path under
parity is what the fast path is checked against (bit for bit, in the parity plugin's tests).

Log-probs are ``log_softmax`` of the *raw* fp32 logits (before temperature, top-k, top-p) of the
sampled token, which is what a teacher-forced replay computes.

**Weights.** :meth:`TorchEngine.stage` hands out a :class:`~unirl.weights.Staged` checked against the
spec of the engine's own model (:meth:`WeightSpec.from_model`); :meth:`TorchEngine.load_weights`
loads a finished one in place (tied ``lm_head`` keeps sharing the embedding) under
``quiesced(version)``, so it is refused while anything is in flight and a bad payload is rejected
before any tensor is touched.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import sys
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from unirl.contracts import EngineCapabilities, ModelAdapter, Receipt, SamplingParams, fingerprint
from unirl.engine.queued import QueuedEngine
from unirl.kernel.errors import ConfigError
from unirl.samples import Sample, now_ms
from unirl.weights import Staged, WeightSpec, stage_all

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.config import RunConfig
    from unirl.runtime import Runtime

_FAST_MODEL_TYPES = ("qwen3", "qwen2", "llama")


class _StaticCache:
    """The slice of transformers' ``Cache`` interface an attention module uses (``update``,
    ``get_seq_length``), over the fast path's preallocated, zero-filled K/V, **left-aligned**: row b's
    key for position j sits at column j, whatever the row's left padding. So a provider's attention
    needs no per-step realignment (the mask it gets is plain causal over positions). ``update`` writes
    this call's keys (the prefill shifted left by each row's padding; a decode step at each row's own
    position) and returns the keys and values of columns ``[0, width)``: ``end`` rounded up to whole
    blocks of the parity provider's ``key_block`` (the columns past ``end`` are zeros and masked; see
    :func:`_key_width`)."""

    def __init__(self, kv: list, pos, end: int, pad=None, *, block: int = 1) -> None:
        self.kv, self.pos, self.end, self.pad = kv, pos, end, pad
        self.width = _key_width(end, kv[0][0].shape[2], block)

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs=None):
        import torch

        K, V = self.kv[layer_idx]
        B, H, T, D = key_states.shape
        if self.pad is not None:  # prefill: column j <- input column j + pad (zeros past the prompt)
            j = torch.arange(T, device=key_states.device)
            src = (j[None, :] + self.pad[:, None]).clamp(max=T - 1)
            keep = (j[None, :] + self.pad[:, None] < T)[:, None, :, None]
            idx = src[:, None, :, None].expand(B, H, T, D)
            K[:, :, :T] = key_states.gather(2, idx) * keep
            V[:, :, :T] = value_states.gather(2, idx) * keep
        else:  # decode: each row's token at its own position (one index_copy_ into the flat cache)
            S = K.shape[2]
            bh = torch.arange(B * H, device=key_states.device).view(B, H)
            idx = (bh * S + self.pos[:, :1]).reshape(-1)
            K.view(-1, D).index_copy_(0, idx, key_states[:, :, 0].reshape(-1, D))
            V.view(-1, D).index_copy_(0, idx, value_states[:, :, 0].reshape(-1, D))
        return K[:, :, : self.width], V[:, :, : self.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.end - 1


def _whole_key_blocks(n: int, block: int) -> int:
    """``n`` rounded up to a whole number of ``block`` s."""
    return -(-n // block) * block


def _key_width(end: int, allocated: int, block: int) -> int:
    """Columns of the static cache a module attention sees for keys ``[0, end)``: ``end`` rounded up
    to whole ``block`` s (the cache is allocated that long), at most ``allocated``."""
    return min(allocated, _whole_key_blocks(end, block))


def _position_mask(pos, end: int):
    """``[B, 1, T, end]`` bool: query at position p sees the left-aligned keys 0..p (of ``end`` columns)."""
    import torch

    return torch.arange(end, device=pos.device)[None, None, None, :] <= pos[:, None, :, None]


def _rms_norm(norm, x):
    """transformers' RMSNorm (Qwen3 / Qwen2 / Llama) as one fused ATen call, in fp32 only: there it gives
    the module's bits (``tests/test_torch_engine.py`` checks widths 16..4,096, 1..333 rows, 1 and 2
    threads) with a sixth of its dispatches, and a decode step at small sizes is mostly dispatch. In
    bf16 the two differ (the fused op applies the weight before rounding to bf16), so bf16 keeps the
    module."""
    import torch.nn.functional as F

    if x.dtype != norm.weight.dtype or x.dtype.itemsize != 4:
        return norm(x)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _rope(x, cos, sin):
    """transformers' ``apply_rotary_pos_emb`` (``x * cos + rotate_half(x) * sin``) on ``x [B, H, T, D]``,
    the heads of q and k together: the same elementwise operations on every element, so the same bits,
    in half the dispatches."""
    import torch

    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, None]


def _rope_qk(q, k, cos, sin):
    """:func:`_rope` on q and k, concatenated over heads and split back."""
    import torch

    out = _rope(torch.cat((q, k), 1), cos, sin)
    return out[:, : q.shape[1]], out[:, q.shape[1] :]


def _qk_norm(q_norm, k_norm, qk, n_q: int):
    """Qwen3's ``q_norm`` and ``k_norm`` on ``qk [B, T, Hq + Hkv, D]`` (q's heads first) in one fused
    RMSNorm. The fused op applies the weight as its last, separate multiply, so normalising without it
    and multiplying by the two weights stacked per head gives each norm's bits (checked in
    ``tests/test_torch_engine.py``). Outside fp32, or with different epsilons, it is two calls."""
    import torch
    import torch.nn.functional as F

    if qk.dtype.itemsize != 4 or q_norm.variance_epsilon != k_norm.variance_epsilon:
        return torch.cat((_rms_norm(q_norm, qk[:, :, :n_q]), _rms_norm(k_norm, qk[:, :, n_q:])), 2)
    w = torch.cat((q_norm.weight.expand(n_q, -1), k_norm.weight.expand(qk.shape[2] - n_q, -1)))
    return F.rms_norm(qk, (qk.shape[-1],), None, q_norm.variance_epsilon) * w


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


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on an int64 tensor, in place (multiplication wraps modulo 2**64)."""
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        t = z >> shift  # logical shift: torch's >> is arithmetic, so mask the sign bits off
        t &= (1 << (64 - shift)) - 1
        z ^= t
        if mult is not None:
            z *= mult
    return z


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """:func:`_mix64_` on a copy."""
    return _mix64_(z.clone())


@functools.cache
def _token_keys(vocab: int, device: str) -> torch.Tensor:
    """``[vocab]`` int64: token id ``i``'s offset ``(i + 1) * gamma`` (wrapping), made once per vocabulary."""
    import torch

    return torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _GAMMA


def gumbel_noise(seeds: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise of shape ``[rows, vocab]``; row r depends only on ``(seeds[r], step)``.

    Computed in place on one ``[rows, vocab]`` buffer: at a decode step's sizes the cost is the
    allocations and dispatches, not the arithmetic."""
    import torch

    key = _mix64_(_mix64(seeds) + _i64((step + 1) * _GAMMA))  # [B]
    h = _mix64_(key[:, None] + _token_keys(vocab, str(seeds.device))[None, :])
    h >>= 40
    h &= (1 << 24) - 1
    u = h.to(torch.float32).add_(0.5).mul_(1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    return u.log_().neg_().log_().neg_()


def sample_tokens(logits: torch.Tensor, sampling: SamplingParams, seeds: torch.Tensor, step: int) -> torch.Tensor:
    """Pick one token per row from fp32 ``logits [B, V]`` under temperature / top-k / top-p."""
    import torch

    if sampling.temperature == 0:
        return logits.argmax(-1)
    x = logits / sampling.temperature if sampling.temperature != 1.0 else logits  # x / 1.0 is x, bit for bit
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

_LENGTH, _STOP, _ABORT = 0, 1, 2
_REASONS = ("length", "stop", "abort")


class TorchEngine(QueuedEngine):
    """Embedded engine: one process, one private copy of the model, eval mode, no autograd."""

    name = "torch"
    Config = TorchEngineConfig

    @classmethod
    def capabilities(cls, config: RunConfig) -> EngineCapabilities:
        return EngineCapabilities(weight_syncs=("inprocess",), logprobs="raw", continuation=True,
                                  async_submit=True)

    def __init__(self, *, config: RunConfig, adapter: ModelAdapter, tokenizer: Any = None, model: Any = None,
                 runtime: Runtime | None = None):
        import torch

        super().__init__()
        try:
            self.options = TorchEngineConfig.model_validate(dict(config.rollout.options))
        except ValidationError as exc:
            msgs = "; ".join(
                f"rollout.options.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
            )
            raise ConfigError(f"invalid options for rollout engine 'torch': {msgs}") from None
        self.config = config
        self.adapter = adapter
        self.runtime = runtime
        self.tokenizer = tokenizer if tokenizer is not None else adapter.build_tokenizer(config)
        if runtime is not None:
            runtime.install_engine(self.name)  # parity: engine-side reference ops before the model exists
        if model is None:
            model = adapter.build_model(config, self.tokenizer)
        else:
            from unirl.packing import disable_packed_attention

            model = copy.deepcopy(model)  # the engine never aliases the caller's (the actor's) tensors
            disable_packed_attention(model)  # an actor's model attends per packed sequence; generate uses sdpa
        dtype = getattr(torch, self.options.dtype or config.model.dtype)
        self.model = model.to(dtype).eval().requires_grad_(False)
        self.dtype = dtype
        self.device = next(self.model.parameters()).device
        seed = self.options.seed if self.options.seed is not None else config.run.seed
        self._generator = torch.Generator().manual_seed(seed)
        # parity: the provider's ops live in the modules, so the fast path calls the attention module
        self.module_attention = runtime is not None and runtime.parity is not None
        #: the parity provider's key chunk (its attention reads the static cache in place in whole blocks)
        self.key_block = runtime.parity.key_block if self.module_attention else 1
        self.fast = self.options.fast_path and self._fast_supported()
        #: per layer, the fused q|k|v and gate|up weights of the fast path (None: the layer's modules)
        self._fused: list[tuple[Any, Any]] = self._fuse_projections() if self.fast and not self.module_attention else []
        self.eos_ids = self._eos_ids()
        self.pad_id = self._pad_id()
        self.spec = WeightSpec.from_model(self.model)
        self._vocab_text: list[str] | None = None
        self._stop_candidates: dict[tuple[str, ...], torch.Tensor] = {}

    def cache_tokens(self) -> int:
        """0: nothing is cached across jobs (a job's KV cache, and a group's shared prefill, live and die
        with that job), so every batch starts on an empty cache."""
        return 0

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
            norms = [layer.input_layernorm, layer.post_attention_layernorm, *(
                [a.q_norm, a.k_norm] if hasattr(a, "q_norm") else [])]
            if not all(hasattr(n, "variance_epsilon") and hasattr(n, "weight") for n in norms):
                return False  # _rms_norm restates transformers' RMSNorm (weight, variance_epsilon)
        self._rope = getattr(sys.modules[type(inner.layers[0].self_attn).__module__], "apply_rotary_pos_emb", None)
        return self._rope is not None

    def _fuse_projections(self) -> list[tuple[Any, Any]]:
        """Put each layer's q / k / v weights, and its MLP's gate / up weights, into one tensor each,
        with the parameters left as views of it. A decode step then runs one GEMM where it ran three
        (and one for two): at decode sizes each call costs more in dispatch than in arithmetic.
        ``load_weights`` copies into the parameters, so the fused tensors always hold the served weights.
        A layer with biases, or an MLP that is not ``down(act(gate(x)) * up(x))``, keeps its modules."""
        import torch

        def fuse(mods) -> Any:
            if any(getattr(m, "bias", None) is not None for m in mods):
                return None
            fused = torch.cat([m.weight.detach() for m in mods])
            at = 0
            for m in mods:
                n = m.weight.shape[0]
                m.weight.data = fused[at : at + n]
                at += n
            return fused

        out = []
        for layer in self.model.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv = fuse((a.q_proj, a.k_proj, a.v_proj))
            glu = all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
            out.append((qkv, fuse((mlp.gate_proj, mlp.up_proj)) if glu else None))
        return out

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

    def _stop_candidate_mask(self, stops: tuple[str, ...]) -> torch.Tensor:
        """``[V]`` bool: tokens that can complete one of ``stops`` (see the module doc). Cached."""
        import torch

        mask = self._stop_candidates.get(stops)
        if mask is not None:
            return mask
        vocab = int(self.model.config.vocab_size)
        if self._vocab_text is None:
            n = min(vocab, len(self.tokenizer))
            self._vocab_text = self.tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=True)
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        lasts = {s[-1] for s in stops if s}
        flags = [i not in special and (not t or "\ufffd" in t or any(c in t for c in lasts))
                 for i, t in enumerate(self._vocab_text)]
        flags += [False] * (vocab - len(flags))  # ids past the tokenizer decode to nothing
        mask = torch.tensor(flags[:vocab], dtype=torch.bool, device=self.device)
        self._stop_candidates[stops] = mask
        return mask

    # ------------------------------------------------------------------ generation
    def _run(self, samples: list[Sample], sampling: SamplingParams, should_stop: Callable[[], bool],
             version: int) -> None:
        import torch

        if not samples:
            return
        # one draw per sample in order, so unseeded runs are reproducible for a given engine seed
        drawn = torch.randint(0, 1 << 62, (len(samples),), generator=self._generator).tolist()
        seeds = []
        for s, d in zip(samples, drawn, strict=True):
            ts = s.turn_seed()
            seeds.append(ts if ts is not None else d)
        limits = [sampling.new_token_limit(s) for s in samples]
        stop_ids = self.eos_ids | set(sampling.stop_token_ids)
        if sampling.ignore_eos:  # eos never ends a turn, even when the trainer listed it as a stop id
            stop_ids -= self.eos_ids
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long)
        stops = tuple(x for x in sampling.stop if x)
        # chunk by context length so rows of a forward have similar padding; results go back in order
        live = [i for i in range(len(samples)) if limits[i] > 0]
        for i in range(len(samples)):
            if limits[i] <= 0:  # the response budget is spent: an empty turn
                samples[i].append_model_turn([], [], version, "length")
        contexts = {i: samples[i].context_ids for i in live}
        order = sorted(live, key=lambda i: (len(contexts[i]), i))
        size = self.options.batch_size
        exact = self.runtime.exact("rollout") if self.runtime is not None else contextlib.nullcontext()
        with torch.inference_mode(), exact:
            for c in range(0, len(order), size):
                idx = order[c : c + size]
                if should_stop():
                    for i in idx:
                        samples[i].append_model_turn([], [], version, "abort")
                    continue
                chunk = [samples[i] for i in idx]

                def first_token(chunk=chunk) -> None:
                    t = now_ms()
                    for s in chunk:
                        s.requests[-1].first_token_ms = t

                toks, lps, reasons, ends = self._generate_batch(
                    [contexts[i] for i in idx], [seeds[i] for i in idx], [limits[i] for i in idx],
                    sampling, stop, stops, should_stop, first_token,
                )
                for s, t, lp, r, end in zip(chunk, toks, lps, reasons, ends, strict=True):
                    reason = _REASONS[r]
                    text_ids = t[:-1] if reason == "stop" and t and t[-1] in stop_ids else t
                    s.append_model_turn(t, lp, version, reason,
                                        text=self.tokenizer.decode(text_ids, skip_special_tokens=True))
                    s.requests[-1].finished_ms = end  # this row's own end, not the job's (see _generate_batch)

    def _generate_batch(self, contexts: list[list[int]], seeds: list[int], limits: list[int],
                        sampling: SamplingParams, stop: torch.Tensor, stops: tuple[str, ...],
                        should_stop: Callable[[], bool], first_token: Callable[[], None],
                        ) -> tuple[list[list[int]], list[list[float]], list[int], list[float]]:
        """Tokens, log-probs, finish reasons and each row's finish time (:func:`now_ms`).

        Why per-row finish times: a row that emits eos (or hits its cap) at step t is done then, even
        though the batch decodes on; stamping every row with the batch's end made per-request latency
        and group completion collapse to batch readiness in traces. ``step_ms[t]`` is taken
        once per step right after that step's device sync (``ended.any()``), so token t of every live
        row exists; a row of length L finished at ``step_ms[L - 1]``, the last step's rows after the
        final copy to the host. One clock read per step: nothing per row."""
        import torch

        B, N = len(contexts), max(limits)
        P = max(len(p) for p in contexts)
        dev = self.device
        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        valid = torch.zeros((B, P + N), dtype=torch.bool)
        for r, p in enumerate(contexts):
            ids[r, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            valid[r, P - len(p) :] = True  # generated positions are valid too (masked rows are ignored)
        ids, valid = ids.to(dev), valid.to(dev)
        plen = torch.tensor([len(p) for p in contexts], dtype=torch.long, device=dev)
        pos = (valid[:, :P].long().cumsum(-1) - 1).clamp(min=0)
        seed_t = torch.tensor(seeds, dtype=torch.int64, device=dev)
        lim = torch.tensor(limits, dtype=torch.long, device=dev)
        uniform = min(limits) == N  # the common case: no per-row budget to check each step
        stop = stop.to(dev)
        cand = self._stop_candidate_mask(stops) if stops else None
        tail = 4 * max((len(x) for x in stops), default=0) + 4  # tokens decoded for a stop-string check

        out_tok = torch.full((B, N), self.pad_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros((B, N), dtype=torch.float32, device=dev)
        lengths = torch.full((B,), N, dtype=torch.long, device=dev)
        reason = torch.full((B,), _LENGTH, dtype=torch.long, device=dev)
        rows = torch.arange(B, device=dev)  # original row of each live row
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        step_ms: list[float] = []  # step t's end on the one clock (see the docstring)

        share = self._shared_prefill(contexts) if self.fast and not self.module_attention else None
        if share is not None:  # rows with equal contexts (a GRPO group) prefill once, then fan out
            first, fan = (t.to(dev) for t in share)
            state = self._select(self._fast_prefill(ids[first], pos[first], valid[first], N), fan)
            state["logits"] = state["logits"][fan]
        else:
            state = self._fast_prefill(ids, pos, valid, N) if self.fast else self._hf_prefill(ids, pos, valid)
        logits = state.pop("logits")
        banned = None  # min_new_tokens: eos and the stop ids cannot be drawn before then
        if sampling.min_new_tokens > 0:
            banned = torch.tensor(sorted(self.eos_ids | set(stop.tolist())), dtype=torch.long, device=dev)
        for t in range(N):
            raw = logits.float()
            pick = raw.index_fill(-1, banned, -math.inf) if banned is not None and t < sampling.min_new_tokens else raw
            tok = sample_tokens(pick, sampling, seed_t, t)
            lp = torch.log_softmax(raw, dim=-1).gather(-1, tok[:, None])[:, 0]
            out_tok[rows, t] = tok
            out_lp[rows, t] = lp
            if t == 0:
                first_token()
            stopped = torch.isin(tok, stop) & ~done
            if cand is not None:
                check = (cand[tok] & ~done & ~stopped).nonzero()[:, 0].tolist()
                for j in check:  # only rows whose new token can end a stop string
                    r = int(rows[j])
                    text = self.tokenizer.decode(out_tok[r, max(0, t + 1 - tail) : t + 1].tolist(),
                                                 skip_special_tokens=True)
                    if any(x in text for x in stops):
                        stopped[j] = True
            if t + 1 == N:  # every row still going ends here: "length" (or "stop" if it just stopped)
                reason[rows[stopped]] = _STOP
                break
            ended = stopped if uniform else stopped | ((lim <= t + 1) & ~done)
            any_ended = bool(ended.any())  # one device sync per step, as before
            step_ms.append(now_ms())  # token t of every live row exists now (see the docstring)
            if any_ended:
                lengths[rows[ended]] = t + 1
                reason[rows[stopped]] = _STOP
                done = done | ended
                live = ~done
                n_live = int(live.sum())
                if n_live == 0:
                    break
                if n_live <= 0.75 * live.numel():  # drop finished rows from the batch
                    keep = live.nonzero()[:, 0]
                    rows, seed_t, plen, lim, done, tok = (rows[keep], seed_t[keep], plen[keep], lim[keep],
                                                          done[keep], tok[keep])
                    state = self._select(state, keep)
            if should_stop():  # aborted: unfinished rows keep what they have
                lengths[rows[~done]] = t + 1
                reason[rows[~done]] = _ABORT
                break
            step_pos = (plen + t)[:, None]
            logits = (self._fast_step if self.fast else self._hf_step)(state, tok[:, None], step_pos, P + t)

        lengths_l = lengths.tolist()
        out_tok_l, out_lp_l = out_tok.tolist(), out_lp.tolist()
        last_ms = now_ms()  # the final step's tokens are on the host now
        toks = [out_tok_l[r][: lengths_l[r]] for r in range(B)]
        lps = [out_lp_l[r][: lengths_l[r]] for r in range(B)]
        ends = [step_ms[n - 1] if 0 < n <= len(step_ms) else last_ms for n in lengths_l]
        return toks, lps, reason.tolist(), ends

    # ------------------------------------------------------------------ fast path
    @staticmethod
    def _shared_prefill(contexts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(first, fan)`` when some rows have equal contexts: ``first`` indexes one row per distinct
        context, and ``fan`` maps every row to its context's position in ``first``. None when all differ.

        The ``n`` samples of a GRPO group share their prompt, so the prefill runs once per prompt and its
        KV cache and first logits are copied to the group's rows (prefix sharing, as vLLM's prefix cache
        does). The rows then decode independently. At the step benchmark's workload (16 prompts x 4) the prefill took
        31 ms of a 360 ms rollout. The engine's rows are equal only up to rounding across batch sizes, so a
        shared prefill's logits can differ from an unshared one's in the last bit; the parity path (module
        attention) never shares."""
        import torch

        index: dict[tuple[int, ...], int] = {}
        first: list[int] = []
        fan = []
        for r, ctx in enumerate(contexts):
            key = tuple(ctx)
            if key not in index:
                index[key] = len(first)
                first.append(r)
            fan.append(index[key])
        if len(first) == len(contexts):
            return None
        return torch.tensor(first, dtype=torch.long), torch.tensor(fan, dtype=torch.long)

    def _fast_prefill(self, ids, pos, valid, max_new: int) -> dict[str, Any]:
        import torch

        m, inner = self.model, self.model.model
        B, P = ids.shape
        cfg = m.config
        a0 = inner.layers[0].self_attn
        head_dim = a0.head_dim if hasattr(a0, "head_dim") else cfg.hidden_size // cfg.num_attention_heads
        # the left-aligned cache of module attention (see _StaticCache) must read zeros past each row's keys
        alloc = torch.zeros if self.module_attention else torch.empty
        cols = P + max_new
        if self.module_attention:  # whole key blocks (see _StaticCache): the attention reads it in place
            cols = _whole_key_blocks(cols, self.key_block)
        shape = (B, cfg.num_key_value_heads, cols, head_dim)
        kv = [(alloc(shape, dtype=self.dtype, device=ids.device), alloc(shape, dtype=self.dtype, device=ids.device))
              for _ in inner.layers]
        if self.module_attention:
            state = {"kv": kv, "valid": valid, "pad": P - valid[:, :P].sum(-1)}
            state["logits"] = self._fast_forward(state, ids, pos, 0, None)
            del state["pad"]
            return state
        causal = torch.ones((P, P), dtype=torch.bool, device=ids.device).tril()
        eye = torch.eye(P, dtype=torch.bool, device=ids.device)
        # pad queries attend to themselves only: no all-masked rows (NaN) anywhere in the cache
        mask = (causal[None] & valid[:, None, :P]) | eye[None]
        state = {"kv": kv, "valid": valid}
        state["logits"] = self._fast_forward(state, ids, pos, 0, mask[:, None])
        return state

    def _fast_step(self, state, tok, pos, start: int):
        import torch

        if self.module_attention:
            return self._fast_forward(state, tok, pos, start, None)
        if "bias" not in state:  # additive mask over the cache for the decode attention
            bias = torch.zeros(state["valid"].shape, dtype=self.dtype, device=state["valid"].device)
            state["bias"] = bias.masked_fill(~state["valid"], -math.inf)[:, None, None, :]
        mask = state["bias"][..., : start + 1]
        return self._fast_forward(state, tok, pos, start, mask)

    def _fast_forward(self, state, ids, pos, start: int, mask):
        """``mask``: the hand-written attention's mask; under module attention ``None`` (the mask follows
        from the static cache's width, which only the cache knows)."""
        import torch
        import torch.nn.functional as F

        m, inner = self.model, self.model.model
        B, T = ids.shape
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, pos)
        end = start + T
        cache = _StaticCache(state["kv"], pos, end, state.get("pad"), block=self.key_block) if self.module_attention else None
        if cache is not None:  # module attention: plain causal over the positions, as wide as the cache reads
            mask = _position_mask(pos, cache.width)
        for i, (layer, (K, V)) in enumerate(zip(inner.layers, state["kv"], strict=True)):
            a = layer.self_attn
            if cache is not None:
                x = layer.input_layernorm(h)
                o = a(x, position_embeddings=(cos, sin), attention_mask=mask, past_key_values=cache,
                      position_ids=pos)[0]
                h = h + o
                h = h + layer.mlp(layer.post_attention_layernorm(h))
                continue
            x = _rms_norm(layer.input_layernorm, h)
            shape = (B, T, -1, K.shape[-1])
            qkv_w, glu_w = self._fused[i]
            if qkv_w is not None:  # q, k and v heads side by side: q and k are normed and rotated together
                n_q, n_kv = a.q_proj.weight.shape[0] // K.shape[-1], K.shape[1]
                heads = F.linear(x, qkv_w).view(shape)
                qk, v = heads[:, :, : n_q + n_kv], heads[:, :, n_q + n_kv :].transpose(1, 2)
                if hasattr(a, "q_norm"):
                    qk = _qk_norm(a.q_norm, a.k_norm, qk, n_q)
                qk = _rope(qk.transpose(1, 2), cos, sin)
                q, k = qk[:, :n_q], qk[:, n_q:]
            else:
                q, k, v = a.q_proj(x).view(shape), a.k_proj(x).view(shape), a.v_proj(x).view(shape)
                if hasattr(a, "q_norm"):
                    q, k = _rms_norm(a.q_norm, q), _rms_norm(a.k_norm, k)
                v = v.transpose(1, 2)
                q, k = _rope_qk(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
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
            x = _rms_norm(layer.post_attention_layernorm, h)
            if glu_w is not None:
                mlp = layer.mlp
                gate, up = F.linear(x, glu_w).chunk(2, -1)
                h = h + mlp.down_proj(mlp.act_fn(gate) * up)
            else:
                h = h + layer.mlp(x)
        norm = inner.norm(h[:, -1]) if cache is not None else _rms_norm(inner.norm, h[:, -1])
        return m.lm_head(norm)

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
    def stage(self) -> Staged:
        return Staged(spec=self.spec)

    def load_weights(self, staged: Staged | Iterable[tuple[str, torch.Tensor]], version: int) -> list[Receipt]:
        """Load a staged set as ``version`` (see :class:`~unirl.contracts.RolloutEngine`).

        For convenience (tests, notebooks) a plain iterable of ``(name, tensor)`` is accepted too: it is
        staged here with :func:`unirl.weights.stage_all` against this engine's spec, so it must be the
        complete model in the serving dtype, exactly like a sync."""
        import torch

        with self.quiesced(version):
            t0 = time.perf_counter()
            if not isinstance(staged, Staged):
                staged = stage_all(self.spec, staged)
            staged.finish()  # completeness, tied head: raises before any tensor is touched
            state = self.model.state_dict()
            with torch.no_grad():
                for name, src in staged.tensors:
                    state[name].copy_(src.to(device=state[name].device))  # a tied head shares the storage
            staged.closed = True
            self._set_version(version)
            # the receipt fingerprints what the engine now holds, not what it was handed
            loaded = [(name, state[name]) for name, _ in staged.tensors]
            return [Receipt(worker=0, version=version, fingerprint=fingerprint(loaded),
                            num_tensors=len(loaded), seconds=time.perf_counter() - t0)]
