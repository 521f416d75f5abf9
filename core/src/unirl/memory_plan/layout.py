"""What a component holds in memory, per device, as it declares it: the types the memory plan sums.

Why declarations: the plan must not know which actor or engine it is looking at (no names, no
``hasattr``). Each actor and engine class answers ``memory_layout(config, options, facts)`` (a classmethod
of the :class:`unirl.contracts.Actor` and :class:`unirl.contracts.RolloutEngine` contracts) with a
:class:`MemoryLayout`: the bytes it will hold on each device, item by item, and the settings that would
shrink it (:class:`Fix`). Two components that name the same device are colocated and add up there.

Imports nothing heavy: ``unirl plan`` builds no model and needs no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

#: "gpu": an accelerator's memory (one budget each); "host": a process on the host (all of them share
#: the host's budget); "external": a process UniRL does not place (an SGLang server): shown, not checked
DeviceKind = Literal["gpu", "host", "external"]


@dataclass(frozen=True)
class MemoryItem:
    """One thing held at the peak: a name a user recognises, its bytes, and how it was counted."""

    name: str
    bytes: int
    note: str = ""


@dataclass(frozen=True)
class DeviceLoad:
    """What one component holds on one device (``gpu:0``, ``rank 1``, ``trainer``)."""

    device: str
    kind: DeviceKind
    items: tuple[MemoryItem, ...]


@dataclass(frozen=True)
class Fix:
    """A setting that would shrink this layout: the override (``field=value``) and what it changes, in
    words. The plan re-plans with it applied to predict its effect; it is offered only if it helps."""

    field: str
    value: Any
    what: str


@dataclass(frozen=True)
class MemoryLayout:
    """A component's declared memory: its loads per device and the fixes it supports."""

    loads: tuple[DeviceLoad, ...]
    fixes: tuple[Fix, ...] = field(default=())


@dataclass(frozen=True)
class ModelFacts:
    """The architecture facts the arithmetic needs, read from the model's config (never its weights)."""

    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    experts: int = 0  # 0: dense MLP
    moe_intermediate: int = 0
    #: the run computes on accelerators: the actor declared GPU loads (the plan sets it before it asks the
    #: engine, so an engine that follows the trainer's platform reads it here, not from another's options)
    accelerator: bool = False

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def attention_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * q + 2 * self.hidden * kv + q * self.hidden + 2 * self.head_dim

    @property
    def mlp_params(self) -> int:
        if self.experts:
            return self.experts * 3 * self.hidden * self.moe_intermediate + self.hidden * self.experts
        return 3 * self.hidden * self.intermediate

    @property
    def block_params(self) -> int:
        """One decoder layer: attention (q/k norms included), MLP or experts + router, two RMSNorms."""
        return self.attention_params + self.mlp_params + 2 * self.hidden

    @property
    def params(self) -> int:
        return self.embedding_params + self.head_params + self.layers * self.block_params + self.hidden

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear of one dense layer, by module name (LoRA adapts these)."""
        q, kv, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        out = {"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
               "o_proj": (q, self.hidden)}
        if not self.experts:
            out.update(gate_proj=(self.hidden, i), up_proj=(self.hidden, i), down_proj=(i, self.hidden))
        return out


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: the public name of a declared fix (unirl.api.MemoryFix)
MemoryFix = Fix
