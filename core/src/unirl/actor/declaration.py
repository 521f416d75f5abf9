"""The embedded actor's declarations, without its implementation: ``actor.options`` (its ``Config``),
``capabilities`` and ``memory_layout``. :class:`unirl.actor.torch_actor.TorchActor` inherits them.

Why a module of its own: ``unirl plan`` reads only these, and the actor's module imports torch and the
whole training stack (1.5 s of CPU, most of the plan's cost). Core registers this class as the actor's
declaration (``unirl_declarations``, read through :meth:`unirl.kernel.manager.Kernel.declaration`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from unirl.actor.memory_layout import torch_actor_layout
from unirl.config import RunConfig
from unirl.contracts import Actor, ActorCapabilities


class TorchActorOptions(BaseModel):
    """``actor.options`` of the embedded actor."""

    model_config = ConfigDict(extra="forbid")

    compute_dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="bfloat16: forward and backward under torch.autocast (matmuls in bf16; norms, "
        "softmax, log-probs and the loss in fp32), master weights, gradients and AdamW state stay fp32. "
        "On a CPU with AMX a bf16 matmul is ~8-10x an fp32 one. None / float32: fp32 throughout")
    compile: bool = Field(False, description="torch.compile each decoder layer's MLP and RMSNorms, the rest "
        "eager (unirl.actor.regional_compile says why), at start-up: the compiling is reported as the metric "
        "compile_s of the first RL step. Measured 2-3 % off a 25 M / 100 M bf16 train phase on a 2-core CPU, "
        "for 7-15 s of compiling. Not with actor.lora, nor under parity (compiled kernels change the bits)")


class TorchActorDeclaration(Actor):
    """What the embedded actor declares before it is built (never instantiated itself)."""

    Config = TorchActorOptions
    memory_layout = classmethod(torch_actor_layout)  # the memory plan's declaration (unirl.actor.memory_layout)

    @classmethod
    def capabilities(cls, config: RunConfig, options: TorchActorOptions | None) -> ActorCapabilities:
        """One rank; it autocasts to ``compute_dtype`` when set and compiles parts under ``compile``."""
        o = options if options is not None else TorchActorOptions()
        return ActorCapabilities(ranks=1, compute_dtype=o.compute_dtype, compiled=bool(o.compile),
                                 fields=(("compute_dtype", "actor.options.compute_dtype"),
                                         ("compiled", "actor.options.compile")))
