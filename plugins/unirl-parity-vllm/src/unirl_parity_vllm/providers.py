"""The ``qwen3`` parity provider: the reference ops of :mod:`unirl_parity_vllm.ops` installed into
transformers' Qwen3 modules, for the trainer's forwards and the embedded engine's.

:meth:`Qwen3ParityProvider.exact_context` replaces, for its duration, the ``forward`` of

* ``torch.nn.Linear`` (every projection, the tied ``lm_head`` and a value head): :func:`ops.linear`;
* ``Qwen3RMSNorm`` (layer norms, the final norm and the per-head q/k norms): :func:`ops.rms_norm`;
* ``Qwen3MLP``: two :func:`ops.linear` + :func:`ops.silu_mul` + :func:`ops.linear`;
* ``Qwen3Attention``: projections, q/k norm, :func:`ops.rope` from the shared cos/sin table, and
  attention. Without a KV cache (the actor's packed replay and training forward: many sequences in
  one row, ``position_ids`` restarting at 0) the sequences are read from ``position_ids`` and run by
  :func:`ops.varlen_attention`. With a cache (the embedded engine's prefill and decode) each row's
  first valid key is read from the attention mask (left padding) and :func:`ops.attention_rows`
  realigns the keys so that key chunk 0 starts at the sequence start.

The patches are class-level and reference counted (nested or concurrent entries install once); on
the last exit every original is put back and checked by identity (:class:`ParityInstallError`
otherwise). A model adapter for another family subclasses :class:`PatchSet` (see ``docs/parity.md``).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

from unirl.api import ParityProvider, UniRLError
from unirl_parity_vllm import parity_enabled


class ParityInstallError(UniRLError):
    """The reference ops could not be installed or removed cleanly (nothing is left half-installed)."""


class PatchSet:
    """A fixed list of ``(owner, attribute, replacement)``, installed and removed as one unit."""

    name = "base"

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._saved: list[tuple[Any, str, Any, Any]] = []

    def patches(self) -> list[tuple[Any, str, Any]]:  # pragma: no cover - subclasses define it
        raise NotImplementedError

    @property
    def installed(self) -> bool:
        return self._depth > 0

    def install(self) -> None:
        with self._lock:
            if self._depth == 0:
                saved = []
                try:
                    for owner, attr, new in self.patches():
                        old = owner.__dict__[attr]  # KeyError: the symbol moved; nothing stays installed
                        saved.append((owner, attr, old, new))
                        setattr(owner, attr, new)
                except Exception as exc:
                    for owner, attr, old, _ in reversed(saved):
                        setattr(owner, attr, old)
                    raise ParityInstallError(f"parity provider {self.name!r}: cannot install: {exc!r}") from exc
                self._saved = saved
            self._depth += 1

    def remove(self) -> None:
        with self._lock:
            if self._depth == 0:
                return
            self._depth -= 1
            if self._depth:
                return
            saved, self._saved = self._saved, []
            for owner, attr, old, _ in reversed(saved):
                setattr(owner, attr, old)
            left = [f"{getattr(o, '__qualname__', o)}.{a}" for o, a, old, _ in saved if o.__dict__.get(a) is not old]
            if left:
                raise ParityInstallError(f"parity provider {self.name!r}: patches not removed: {left}")

    def originals(self) -> dict[str, Any]:
        """``"Owner.attr" -> original`` for every symbol this set replaces (for tests and manifests)."""
        return {f"{o.__qualname__}.{a}": o.__dict__[a] for o, a, _ in self.patches()}


# ----------------------------------------------------- HF decoder forwards (shared by model families)
# Families whose modules differ only in names and in q/k norm (Qwen3, Llama, ...) reuse these; a
# third-party provider lists its own module classes in a PatchSet (see docs/examples).
#
# Compute dtype (bf16 compute on fp32 master weights). Every forward below runs in
# the dtype of its activations, casting a parameter to it on use (``.to`` is differentiable: the
# gradient reaches the fp32 master weight in fp32). The activations take the compute dtype at the
# token embedding (:func:`embedding_forward`), set per ``exact_context`` from ``model.dtype``
# (:data:`COMPUTE_DTYPE`). The round-to-nearest cast of an fp32 weight is the bf16 weight the engine
# was sent, so the actor computes on the very bytes the engine serves. An fp32 run casts nothing.

#: the dtype the token embedding hands the decoder inside ``exact_context`` (None: the weight's own)
COMPUTE_DTYPE: contextvars.ContextVar[Any] = contextvars.ContextVar("unirl_parity_compute_dtype", default=None)


def _as(t, x):
    """Parameter ``t`` (or None) in the dtype of activation ``x``."""
    return t if t is None or t.dtype == x.dtype else t.to(x.dtype)


def embedding_forward(self, input):  # noqa: A002 - torch's name
    import torch.nn.functional as F

    dtype = COMPUTE_DTYPE.get()
    w = self.weight if dtype is None or self.weight.dtype == dtype else self.weight.to(dtype)
    return F.embedding(input, w, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse)


def linear_forward(self, x):
    from unirl_parity_vllm import ops

    return ops.linear(x, _as(self.weight, x), _as(self.bias, x))


def rms_norm_forward(self, hidden_states):
    from unirl_parity_vllm import ops

    return ops.rms_norm(hidden_states, _as(self.weight, hidden_states), self.variance_epsilon)


def mlp_forward(self, x):
    from unirl_parity_vllm import ops

    gate = ops.linear(x, _as(self.gate_proj.weight, x), _as(self.gate_proj.bias, x))
    up = ops.linear(x, _as(self.up_proj.weight, x), _as(self.up_proj.bias, x))
    h = ops.silu_mul(gate, up)
    return ops.linear(h, _as(self.down_proj.weight, h), _as(self.down_proj.bias, h))


def rope_theta(config: Any, family: str) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ParityInstallError(f"{family} parity supports default RoPE only, not {params.get('rope_type')!r}")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ParityInstallError(f"{family} parity: the model config has no rope_theta")
    return float(theta)


def sequence_starts(position_ids):
    """``cu_seqlens`` of the flattened ``[B, T]`` rows: a sequence starts at every row start and
    wherever a position does not continue the previous one (transformers' packed layout)."""
    import torch

    B, T = position_ids.shape
    pos = position_ids.reshape(-1)
    start = torch.ones_like(pos, dtype=torch.bool)
    if pos.numel() > 1:
        start[1:] = pos[1:] != pos[:-1] + 1
    start[::T] = True
    idx = start.nonzero()[:, 0]
    return torch.cat([idx, idx.new_tensor([pos.numel()])]).to(torch.int32)


def key_starts(attention_mask, num_keys: int):
    """First valid key column of every row, from the mask the attention layer receives (4-D bool or
    additive float, ``[B, 1, T, S]``; the last query of a row is a real token), or zeros for None."""
    import torch

    if attention_mask is None:
        return None
    m = attention_mask
    if m.dim() == 2:
        valid = m.bool()
    else:
        last = m[:, 0, -1, :] if m.dim() == 4 else m[:, -1, :]
        valid = last if last.dtype == torch.bool else last == 0
    valid = valid[:, -num_keys:]
    if not bool(valid.any(-1).all()):
        raise ParityInstallError("qwen3 parity: a row of the attention mask has no valid key")
    return valid.to(torch.int8).argmax(-1)


def attention_forward(family: str, *, qk_norm: bool):
    """The decoder attention forward of one family on the reference ops: ``qk_norm`` applies the
    module's per-head ``q_norm`` / ``k_norm`` (Qwen3) or not (Llama). Packed replay and training
    forwards (no KV cache) go through ``varlen_attention`` over the sequences ``position_ids`` mark;
    the engine's left-padded rows with a KV cache through ``attention_rows``."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                **kwargs):
        import torch

        from unirl_parity_vllm import ops

        B, T, _ = hidden_states.shape
        D = self.head_dim
        shape = (B, T, -1, D)
        x = hidden_states
        q = ops.linear(x, _as(self.q_proj.weight, x), _as(self.q_proj.bias, x)).view(shape)
        k = ops.linear(x, _as(self.k_proj.weight, x), _as(self.k_proj.bias, x)).view(shape)
        if qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        v = ops.linear(x, _as(self.v_proj.weight, x), _as(self.v_proj.bias, x)).view(shape)
        pos = kwargs.get("position_ids")
        if pos is None:
            past = past_key_values.get_seq_length(self.layer_idx) if past_key_values is not None else 0
            pos = torch.arange(past, past + T, device=hidden_states.device)[None].expand(B, T)
        pos = pos.expand(B, T).to(torch.long)
        need = max(int(self.config.max_position_embeddings), int(pos.max()) + 1)
        cos, sin = ops.rope_cos_sin(D, rope_theta(self.config, family), need)
        q = ops.rope(pos.reshape(-1), q.reshape(B * T, -1, D), cos, sin).view(shape)
        k = ops.rope(pos.reshape(-1), k.reshape(B * T, -1, D), cos, sin).view(shape)
        if past_key_values is None:  # packed replay / training forward
            cu = sequence_starts(pos)
            o = ops.varlen_attention(q.reshape(B * T, -1, D), k.reshape(B * T, -1, D), v.reshape(B * T, -1, D),
                                     cu, self.scaling).view(B, T, -1, D)
        else:  # engine: left-padded rows with a KV cache
            k_all, v_all = past_key_values.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_idx)
            k_all, v_all = k_all.transpose(1, 2), v_all.transpose(1, 2)  # [B, S, Hkv, D]
            starts = key_starts(attention_mask, k_all.shape[1])
            o = ops.attention_rows(q, k_all, v_all, pos, self.scaling, key_start=starts)
        o = o.reshape(B, T, -1)
        return ops.linear(o, _as(self.o_proj.weight, o), _as(self.o_proj.bias, o)), None

    forward.__qualname__ = f"attention_forward[{family}]"
    return forward


_qwen3_attention_forward = attention_forward("qwen3", qk_norm=True)


class Qwen3Patches(PatchSet):
    name = "qwen3"

    def patches(self) -> list[tuple[Any, str, Any]]:
        import torch
        from transformers.models.qwen3 import modeling_qwen3 as m

        return [
            (torch.nn.Linear, "forward", linear_forward),
            (torch.nn.Embedding, "forward", embedding_forward),
            (m.Qwen3RMSNorm, "forward", rms_norm_forward),
            (m.Qwen3MLP, "forward", mlp_forward),
            (m.Qwen3Attention, "forward", _qwen3_attention_forward),
        ]


_QWEN3 = Qwen3Patches()


class Qwen3ParityProvider(ParityProvider):
    """``qwen3``: enabled by ``UNIRL_PARITY_ENABLE=1``; see the module doc."""

    patch_set: PatchSet = _QWEN3
    #: ``ops.KEY_CHUNK`` (ops imports torch, this module does not; a test keeps the two equal): the
    #: embedded engine serves its cache in blocks of it so :func:`ops.attention_rows` reads it in place
    key_block = 32

    def __init__(self, *, config: Any) -> None:
        super().__init__(config=config)
        self.engines: list[str] = []

    def enabled(self) -> bool:
        return parity_enabled()

    def compute_dtype(self) -> Any:
        """The dtype the decoder computes in: ``model.dtype`` (bf16: the actor's fp32 master weights are
        cast on use, the engine's are bf16 already; fp32: nothing is cast). A provider built without a
        run config (the vLLM side's own checks) casts nothing."""
        import torch

        model = getattr(self.config, "model", None)
        return torch.bfloat16 if getattr(model, "dtype", "float32") == "bfloat16" else None

    @contextlib.contextmanager
    def exact_context(self, phase: str) -> Iterator[None]:
        self.patch_set.install()
        token = COMPUTE_DTYPE.set(self.compute_dtype())
        try:
            yield
        finally:
            COMPUTE_DTYPE.reset(token)
            self.patch_set.remove()

    def install_engine(self, engine: str) -> None:
        """``torch``: the embedded engine runs its generation inside ``exact_context("rollout")`` on
        the transformers path (core's torch engine does so whenever its runtime has a provider);
        here the patch targets are only resolved, so a moved symbol fails before the model is built.
        ``vllm``: parity B's installer patches vLLM's internals (idempotent; the general plugin
        usually ran it already in this process)."""
        if engine == "torch":
            self.patch_set.patches()
        elif engine == "vllm":
            from unirl_parity_vllm import vllm_side

            vllm_side.install()
        else:
            raise ParityInstallError(f"qwen3 parity: no engine-side install for engine {engine!r}")
        self.engines.append(engine)


def installed() -> bool:
    """Whether the qwen3 reference ops are installed right now (tests)."""
    return _QWEN3.installed
